"""datatrove's tokenization of a JSON-lines corpus: the other side of the data benchmark.

Runs in a virtual environment that has datatrove (it does not import titan_hydra):

    python -m venv /tmp/dt && /tmp/dt/bin/pip install "datatrove[processing]==0.10.1" orjson==3.13.0
    python recipes/benchmark.py --suite data --datatrove-python /tmp/dt/bin/python

``benchmark.py`` calls it on the same generated corpus, with the same tokenizer file, worker count
and heap cap as ``recipes/prepare_data.py``, and prints both in one table. What it runs is
datatrove's own recipe for pretraining data: ``JsonlReader`` -> ``DocumentTokenizer`` (uint16
tokens plus a document index per task; document shuffling off, as ``prepare_data`` keeps file
order) under ``LocalPipelineExecutor`` with one task per input file. It prints one JSON line:
tokens written, wall seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.tokens import DocumentTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="directory of .jsonl files")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json file")
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--eos", default=None, help="EOS token text appended to every document")
    args = p.parse_args()
    files = sorted(Path(args.corpus).glob("*.jsonl"))
    out = Path(args.out)
    t0 = time.time()
    LocalPipelineExecutor(
        pipeline=[
            JsonlReader(args.corpus, glob_pattern="*.jsonl", text_key="text"),
            DocumentTokenizer(output_folder=str(out / "tokens"), tokenizer_name_or_path=args.tokenizer,
                              eos_token=args.eos, shuffle_documents=False),
        ],
        tasks=len(files), workers=args.workers, logging_dir=str(out / "logs"),
    ).run()
    wall = time.time() - t0
    token_bytes = sum(f.stat().st_size for f in (out / "tokens").glob("*.ds"))
    print(json.dumps({"tokens": token_bytes // 2, "wall_s": wall, "files": len(files)}))


if __name__ == "__main__":
    main()
