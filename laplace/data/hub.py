"""Reading `datasets` corpora: a hub dataset (or a local dataset folder) streamed and cut into
its own file shards, and a `save_to_disk` dataset read memory-mapped in row ranges. A network
failure is HubUnreachable (retried), not bad input."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from laplace.config import DataSection
from laplace.data.units import RECORD_BATCH, Unit, checked_record
from laplace.errors import DataError, Failure, one_line


def is_saved_dataset(path: Path) -> bool:
    """A `datasets` save_to_disk directory (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _hub_where(data: DataSection) -> str:
    return f"{data.hub_path!r}" + (f" ({data.hub_name})" if data.hub_name else "") + f" split {data.hub_split!r}"


def _load_hub(data: DataSection):
    """The hub dataset (or a local dataset directory) as a streaming IterableDataset."""
    import datasets

    local = os.path.isdir(data.hub_path)
    if local and is_saved_dataset(Path(data.hub_path)):
        loaded = datasets.load_from_disk(data.hub_path)
        if isinstance(loaded, datasets.DatasetDict):
            if data.hub_split not in loaded:
                raise DataError(
                    f"data.hub_split: {data.hub_path} has no split {data.hub_split!r} ({', '.join(loaded)})"
                )
            loaded = loaded[data.hub_split]
        return loaded.to_iterable_dataset(num_shards=max(1, min(data.slices, len(loaded))))
    try:
        return datasets.load_dataset(data.hub_path, data.hub_name or None, split=data.hub_split, streaming=True)
    except Exception as exc:
        if local and data.hub_name:
            # A local folder of JSONL/Parquet files has no configurations: the default hub_name is
            # ignored for it (a local copy of a hub repository with configurations still uses it).
            try:
                return datasets.load_dataset(data.hub_path, None, split=data.hub_split, streaming=True)
            except Exception:
                pass
        _raise_if_network(exc, f"could not load {_hub_where(data)}")
        raise DataError(f"data.hub_path: could not load {_hub_where(data)}: {one_line(exc)}") from exc


class HubUnreachable(Failure):
    """The hub (or the network to it) failed: not the input's fault, so a crash the flow retries."""


# transport errors of the clients under `datasets` (requests, urllib3, httpx, aiohttp), by name so
# that none of them has to be imported here
_NETWORK_ERRORS = {
    "ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout", "RemoteProtocolError",
    "Timeout", "ReadTimeoutError", "MaxRetryError", "NewConnectionError", "ProtocolError", "ClientConnectorError",
    "ServerDisconnectedError", "OfflineModeIsEnabled",
}  # fmt: skip


def _raise_if_network(exc: BaseException, what: str) -> None:
    seen = exc
    while seen is not None:
        names = {k.__name__ for k in type(seen).__mro__}
        if isinstance(seen, (ConnectionError, TimeoutError)) or names & _NETWORK_ERRORS:
            raise HubUnreachable(f"data.hub_path: {what}: the hub is unreachable ({one_line(seen)}); retry") from exc
        seen = seen.__cause__ or seen.__context__


def hub_units(data: DataSection) -> list[Unit]:
    shards = _load_hub(data).num_shards
    parts = max(1, min(data.slices, shards))
    return [Unit(f"shard-{i:05d}", "hub", data.hub_path, i, parts) for i in range(parts)]


def hub_texts(unit: Unit, data: DataSection) -> Iterator[str | None]:
    stream = _load_hub(data).shard(num_shards=unit.parts, index=unit.part)
    where = f"{_hub_where(data)} {unit.name}"
    try:
        for row in stream:
            if data.text_field not in row:
                raise DataError(f"data.text_field: {where} has no field {data.text_field!r} (fields: {', '.join(row)})")
            yield checked_record(row[data.text_field], where, data.text_field)
    except DataError:
        raise
    except Exception as exc:
        _raise_if_network(exc, f"reading {where} failed")
        raise DataError(f"data.hub_path: reading {where} failed: {one_line(exc)}") from exc


def saved_texts(unit: Unit, data: DataSection) -> Iterator[str | None]:
    import datasets

    loaded = datasets.load_from_disk(unit.location)  # memory-mapped Arrow: nothing is copied
    if isinstance(loaded, datasets.DatasetDict):
        if data.hub_split not in loaded:
            raise DataError(f"data.hub_split: {unit.location} has no split {data.hub_split!r} ({', '.join(loaded)})")
        loaded = loaded[data.hub_split]
    if data.text_field not in loaded.column_names:
        fields = ", ".join(loaded.column_names)
        raise DataError(f"{unit.location}: no field {data.text_field!r} (data.text_field; fields: {fields})")
    start, stop = len(loaded) * unit.part // unit.parts, len(loaded) * (unit.part + 1) // unit.parts
    column = loaded.select_columns([data.text_field])
    for begin in range(start, stop, RECORD_BATCH):
        rows = column[begin : min(begin + RECORD_BATCH, stop)][data.text_field]
        for value in rows:
            yield checked_record(value, unit.location, data.text_field)
