"""A compiled, padded `laplace serve` whose warmup skips every decode width but 1 (for
test_server.py): the server code is the real one, only the warmup list is cut short. Its graphs
compile with Dynamo's eager backend: the refusal under test is Dynamo's fail_on_recompile stance,
whatever the backend (Inductor's two graphs cost ~60 s of g++ here; a server serving Inductor's
graphs without compiling is tests/test_warmup.py's).

    python tests/serve_unwarmed.py EXPORT_DIR PORT
"""

import sys

from laplace.config import config_from_dict
from laplace.serving.engine import DecodeEngine
from laplace.serving.server import serve

if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    export_dir, port = sys.argv[1], int(sys.argv[2])
    cfg = config_from_dict({"engine": {"max_slots": 2, "prefill_buckets": [32], "max_prompt_tokens": 32}})
    # ladder [1, 2], compiled (by Dynamo, the eager backend: see above)
    engine, tokenizer, config = DecodeEngine.from_export(export_dir, cfg.engine, "padded", backend="eager")
    sys.exit(
        serve(
            engine,
            tokenizer,
            config["eos_id"],
            host="127.0.0.1",
            port=port,
            model_name="laplace-gla",
            max_tokens_limit=1024,
            shutdown_grace_s=5.0,
            warmup_widths=[1],
        )
    )
