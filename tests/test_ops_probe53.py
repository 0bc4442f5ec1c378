"""What an operator running ``calexec serve`` met at stop 53 (its monitoring and its files).

- the dump sink's cap (``--dump-max-bytes``) counted the bytes the sink had written since the
  process started, not the size of its file: a dump file rotated away (renamed, as logrotate
  does by default, or truncated in place by ``copytruncate``) left a new, small file, and once
  the old one's bytes reached the cap every record was dropped for the rest of the process.
"""

from __future__ import annotations

import json
import os

from calexec.drivers.serving.dumpsink import DumpSink


def record(i: int) -> dict:
    return {"request_id": i, "pad": "x" * 60}


def test_a_dump_file_rotated_away_is_written_again_not_dropped(tmp_path):
    """Three records fill the cap; the file is renamed away (logrotate's default), then
    emptied in place (``copytruncate``): each time the sink writes the next records into the
    file that is there, as the cap is a bound on that file."""
    sink = DumpSink(tmp_path / "dump", max_bytes=300)
    assert [sink.write(record(i)) for i in range(4)] == [True, True, True, False]
    assert sink.dropped == 1
    os.rename(sink.path, f"{sink.path}.1")  # rotated: the next write makes a new file
    assert [sink.write(record(10 + i)) for i in range(3)] == [True, True, True]
    lines = sink.path.read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == [10, 11, 12]
    os.truncate(sink.path, 0)  # copytruncate: the same file, emptied
    assert sink.write(record(20)) is True
    assert [json.loads(line)["request_id"]
            for line in sink.path.read_text().splitlines()] == [20]
    assert sink.records == 7 and sink.dropped == 1 and sink.errors == 0
    assert sink.path.stat().st_size <= sink.max_bytes
