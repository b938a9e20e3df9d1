"""The scheduler (laplace/serving/scheduler.py) on its own, no model: its decisions on a scripted
arrival sequence, checked exactly (admissions, slots, decode rows and widths, rejections, the
virtual clock), driven the way the engine's step drives it."""

from laplace.serving.cache_manager import SlotPool
from laplace.serving.scheduler import Request, Scheduler

PREFILL_S, DECODE_S = 1.0, 0.5


def scheduler(max_slots=2, widths=(1, 2), exact=False, max_queue=3):
    pool = SlotPool(max_slots)
    s = Scheduler(
        ladder=list(widths),
        exact_widths=exact,
        max_queue=max_queue,
        max_prompt_tokens=8,
        vocab_size=50,
        release=pool.release,
    )
    return s, pool


def step(s: Scheduler, pool: SlotPool) -> tuple[list[tuple[int, int]], list[int], int | None]:
    """One engine step with a fake model: a request's first token is 10 + its id, every decode
    token is 7. Returns ((request, slot) admitted, the decode rows' request ids, the width)."""
    admitted = []
    while (req := s.next_admission(pool.free)) is not None:
        row = s.start(req, pool.acquire(req.id))
        s.record("prefill", PREFILL_S, 16, 1, False)
        s.emit(row, 10 + req.id)
        admitted.append((req.id, row.slot))
    plan = s.decode_plan()
    if plan is None:
        return admitted, [], None
    s.record("decode", DECODE_S, plan.width, len(plan.rows), False)
    for row in plan.rows:
        s.emit(row, 7)
    return admitted, [r.request.id for r in plan.rows], plan.width


def test_the_scheduler_admits_decodes_and_finishes_a_scripted_arrival_sequence_exactly():
    s, pool = scheduler()
    for r in (Request(1, [1, 2], 3), Request(2, [3], 1), Request(3, [4], 2), Request(4, [5], 2)):
        s.submit(r)
    rejected = s.submit(Request(5, [], 2))  # bad: rejected at once, the queue unchanged
    assert rejected.status == "rejected" and rejected.reason == "empty prompt"
    assert [c.reason for c in s.take_finished()] == ["queue full (3 waiting)", "empty prompt"]  # request 4 shed
    # step 0: 1 in slot 0; 2 ends at its first token (max 1) and frees slot 1 within the step; 3 takes it
    assert step(s, pool) == ([(1, 0), (2, 1), (3, 1)], [1, 3], 2)
    assert [(c.request_id, c.output_ids) for c in s.take_finished()] == [(2, [12]), (3, [13, 7])]
    s.submit(Request(6, [9], 10, stop_ids=(7,)))  # stops at its first decode token
    assert step(s, pool) == ([(6, 1)], [1, 6], 2)
    done = s.take_finished()
    assert [(c.request_id, c.output_ids, c.status) for c in done] == [(1, [11, 7, 7], "done"), (6, [16, 7], "done")]
    # the clock: 3 prefills and a decode in step 0, a prefill and a decode in step 1
    assert [(st.kind, st.start_s, st.width, st.live) for st in s.take_steps()] == [
        ("prefill", 0.0, 16, 1),
        ("prefill", 1.0, 16, 1),
        ("prefill", 2.0, 16, 1),
        ("decode", 3.0, 2, 2),
        ("prefill", 3.5, 16, 1),
        ("decode", 4.5, 2, 2),
    ]
    first = done[0]
    assert (first.admitted_s, first.token_times, first.finished_s) == (0.0, [1.0, 3.5, 5.0], 5.0)
    assert not s.has_work() and pool.free == 2
    # one request alone decodes at width 1; cancelled while running, its slot comes back
    s.submit(Request(8, [1], 5))
    assert step(s, pool) == ([(8, 0)], [8], 1)
    cancelled = s.cancel(8, "client went away")
    assert (cancelled.status, cancelled.output_ids, pool.free) == ("cancelled", [18, 7], 2)
    assert s.cancel(8) is None and s.decode_plan() is None


def test_the_decode_width_is_the_smallest_ladder_width_or_the_live_count():
    padded, _ = scheduler(max_slots=5, widths=(1, 2, 4, 8))
    exact, _ = scheduler(max_slots=5, widths=(1, 2, 4, 8), exact=True)
    assert [padded.width_for(n) for n in range(1, 6)] == [1, 2, 4, 4, 8]
    assert [exact.width_for(n) for n in range(1, 6)] == [1, 2, 3, 4, 5]


def test_counts_cancel_all_and_taking_some_requests_finished():
    """What the engine loop reads and does between steps (counts, a drain's and a stop's cancels)
    and what `complete` takes (its own requests' completions, the others' left)."""
    s, pool = scheduler(max_slots=2, max_queue=4)
    for i in range(4):
        s.submit(Request(i, [1], 5))
    step(s, pool)  # 0 and 1 running, 2 and 3 waiting
    assert s.counts() == (2, 2)
    s.cancel_all("draining", waiting_only=True)
    assert s.counts() == (0, 2) and pool.free == 0
    assert [(c.request_id, c.status, c.reason) for c in s.take_finished({3, 2})] == [
        (2, "cancelled", "draining"),
        (3, "cancelled", "draining"),
    ]
    s.submit(Request(4, [1], 5))
    s.cancel_all("stopped")
    assert s.counts() == (0, 0) and pool.free == 2 and not s.has_work()
    assert [(c.request_id, c.reason, len(c.output_ids)) for c in s.take_finished()] == [
        (4, "stopped", 0),
        (0, "stopped", 2),
        (1, "stopped", 2),
    ]
