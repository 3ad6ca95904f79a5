"""What the bench/ scripts share. torch is imported where used, so that bench/ncu_summary.py runs without it."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import platform
import subprocess
import time
from pathlib import Path

try:
    import pandas as pd
except ImportError as exc:
    raise SystemExit(f"bench/ needs pandas ({exc}): pip install pandas tqdm matplotlib") from exc

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_size(text) -> int:
    """'4096' -> 4096, '4k' / '4K' -> 4096 (an argparse type)."""
    t = str(text).strip().lower()
    try:
        return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give an integer such as 4096, or 4k") from None


def fmt_size(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def git_commit() -> str:
    """Short hash of this checkout, '+dirty' when a tracked file differs from it."""
    def git(*cmd):
        return subprocess.run(["git", "-C", str(REPO_ROOT), *cmd], capture_output=True, text=True, timeout=10)
    try:
        sha = git("rev-parse", "--short", "HEAD")
        if sha.returncode:
            return "unknown (not a git checkout)"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return sha.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"


SOURCE_SUFFIXES = (".py", ".h", ".cuh", ".cu", ".cpp")


def source_digest(root: Path = REPO_ROOT) -> str:
    """The first 12 hex digits of a sha256 over the code a result ran: csrc/ and flash_cuda/'s
    sources and bench/'s scripts, each by its path and bytes. It names the code where a copy's git
    metadata does not (a tree copied without its history, or with an older one); at a commit,
    `python3 bench/common.py --digest` prints it."""
    files = sorted(f for d in ("csrc", "flash_cuda") for f in (root / d).rglob("*")
                   if f.is_file() and f.suffix in SOURCE_SUFFIXES) + sorted((root / "bench").glob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def environment(**extra) -> dict:
    """What a result depends on: date, host, GPU, torch / CUDA / cuDNN, the git commit and the
    sources' digest, then `extra`."""
    import torch
    gpu = "none (CUDA not available)"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": f"{platform.node()}, python {platform.python_version()}", "gpu": gpu,
            "torch": f"{torch.__version__}, CUDA {torch.version.cuda}, cuDNN {cudnn}, "
                     f"tf32 matmul {torch.backends.cuda.matmul.allow_tf32}",
            "git commit": git_commit(), "sources": source_digest(), **extra}


def env_lines(env: dict) -> list[str]:
    return [f"{k}: {v}" for k, v in env.items()]


class Timer:
    """Median ms by triton.testing.do_bench, which flushes the L2 before every repeat (torch's CUDA wheels ship it)."""

    def __init__(self, warmup_ms: float = 25.0, rep_ms: float = 100.0):
        try:
            import triton
            from triton.testing import do_bench
        except ImportError:
            raise SystemExit("bench/ times with triton.testing.do_bench, but triton is not importable: "
                             "pip install triton") from None
        self.do_bench, self.warmup_ms, self.rep_ms = do_bench, warmup_ms, rep_ms
        self.name = f"triton {triton.__version__} do_bench, median, L2 flushed"

    def __call__(self, fn, grad_to_none=()) -> float:
        return float(self.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, grad_to_none=list(grad_to_none) or None,
                                   return_mode="median"))


def loop_ms(fn, iters: int) -> float:
    """ms per call of ``iters`` back-to-back calls between two CUDA events: for steps do_bench cannot
    time alone (a whole model's training step, a collective that every rank must enter together)."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def host_us_per_call(step, calls: int, warmup: int) -> float:
    """Microseconds per call of `calls` calls synchronized once: the host's pace when the GPU work is tiny."""
    return host_us_queued_and_synced(step, calls, warmup)[1]


def host_us_queued_and_synced(step, calls: int, warmup: int):
    """(us per call until the last of `calls` calls is queued, us per call until the GPU finished them)."""
    import torch
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    return (queued - start) / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


def fmt(series: pd.Series, spec: str) -> pd.Series:
    """Numbers as text in `spec`, missing ones as ''."""
    return series.map(lambda x: "" if pd.isna(x) else format(x, spec))


def markdown(df: pd.DataFrame, floatfmt: str = "", align=None) -> str:
    """A GitHub table (DataFrame.to_markdown needs tabulate). align: one per column, one for all, or None."""
    if align is None:
        align = ["---:" if pd.api.types.is_numeric_dtype(t) else "---" for t in df.dtypes]
    align = [align] * len(df.columns) if isinstance(align, str) else align
    cells = [["" if pd.isna(x) else format(x, floatfmt) if isinstance(x, float) else str(x) for x in row]
             for row in df.itertuples(index=False)]
    return "\n".join(["| " + " | ".join(map(str, df.columns)) + " |", "|" + "|".join(align) + "|",
                      *("| " + " | ".join(r) + " |" for r in cells)])


def write_csv(df: pd.DataFrame, path, env: dict) -> None:
    """df as CSV below '# key: value' lines of env (read_csv(comment='#') skips them)."""
    with open(path, "w", newline="") as f:
        f.writelines(f"# {line}\n" for line in env_lines(env))
        df.to_csv(f, index=False)


def write_results(out_dir, name: str, df: pd.DataFrame, title: str, env: dict, body: list[str]) -> None:
    """out_dir/<name>.csv and out_dir/<name>.md: the title, env in a code block, then body."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(df, out_dir / f"{name}.csv", env)
    (out_dir / f"{name}.md").write_text("\n".join([f"# {title}", "", "```", *env_lines(env), "```", "", *body]) + "\n")
    print(f"\nwrote {out_dir / name}.csv and {name}.md")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="bench/'s shared helpers; --digest prints this tree's source digest")
    ap.add_argument("--digest", action="store_true", help="print source_digest() of this checkout")
    if ap.parse_args().digest:
        print(source_digest())
