"""A/B of two flash_cuda source trees on one GPU: is a change free of speed and output changes?

A structural change (files split, shared memory typed, a policy moved) must leave every kernel's
speed and every forward output as they were; a lever must show what it gains. Timings from two
runs or two machines differ by more than such a change could, so both builds run side by side
and are timed alternately, cell by cell, in interleaved rounds:

    python3 bench/ab_builds.py --base /path/to/base/checkout --new . --rounds 3

Each tree is built (or found in its cache) at first use by a subprocess that imports that tree's
flash_cuda (``FLASH_CUDA_CACHE_DIR`` keeps the builds apart). Each build then lives in a worker
process of its own (``--worker``), which loads its extension module by file and calls the raw
``fwd`` / ``bwd`` entries on inputs drawn from the seed the parent gives both workers, so both
see the same fresh random inputs.

``--one-process`` loads both modules by file into this process (the same-call A/B). Two builds
of one module name would share a module there: pybind11 keeps one module per name and hands the
first out again (so the d = 256 80-key forward once gave the base build's outputs bit for bit in
one process, and its own, different ones in a process of its own). So each build is then
compiled in a namespace and under a module name of its own (FLASH_CUDA_NAMESPACE:
flash_cuda_ab_base / flash_cuda_ab_new), the kernels one call of each build launches are read
with torch.profiler and must carry that build's namespace, and both builds run on the very same
input tensors, timed call by call in turn (base, new, base, new, ... in one loop, each call after
an L2 flush and between its own CUDA events: paired_times). A tree whose build predates
FLASH_CUDA_NAMESPACE stops the run there.

Per cell: forward outputs (O and LSE) compared bit for bit, gradients
compared to each other (dQ is summed by atomics in a varying order, so it may differ by
rounding), and the pooled median time of each build over the rounds (``triton.testing.do_bench``,
L2 flushed; in one process paired_times), reported as new / base speed (above 1: the new build is faster).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


_BUILD_SNIPPET = """
import json, sys
sys.path.insert(0, sys.argv[1])
import flash_cuda, flash_cuda._ext as ext
m = ext.require()
print(json.dumps({"file": m.__file__, "package": flash_cuda.__file__}))
"""


def build(tree: Path, cache: Path, namespace: str = "") -> Path:
    """Builds (or finds) ``tree``'s kernels in ``cache`` (in C++ namespace ``namespace`` when given);
    the extension module's file."""
    env = dict(os.environ, FLASH_CUDA_CACHE_DIR=str(cache))
    env.pop("FLASH_CUDA_NAMESPACE", None)
    if namespace:
        env["FLASH_CUDA_NAMESPACE"] = namespace
    res = subprocess.run([sys.executable, "-c", _BUILD_SNIPPET, str(tree)], env=env, capture_output=True,
                         text=True, cwd=str(tree))
    if res.returncode:
        raise SystemExit(f"building {tree} failed:\n{res.stdout}\n{res.stderr}")
    info = json.loads(res.stdout.strip().splitlines()[-1])
    if not info["package"].startswith(str(tree.resolve())):
        raise SystemExit(f"{tree}: imported flash_cuda from {info['package']}, not from the tree")
    return Path(info["file"])


def load(path: Path, tag: str):
    """Loads one build's extension module from its file (its name is the file's up to the first
    dot: flash_cuda_kernels, or flash_cuda_kernels_<namespace>; see flash_cuda/_ext.py)."""
    # torch first: the module links against its libraries (libc10, ...), which the dynamic loader
    # finds only once torch has loaded them (a worker process starts without them).
    import torch  # noqa: F401

    name = Path(path).name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules.pop(name, None)
    mod.ab_tag = tag
    return mod


class Worker:
    """One build in a process of its own (``ab_builds.py --worker FILE``), asked in turn by the
    parent over its stdin / stdout, one JSON line each way."""

    def __init__(self, path: Path, tag: str):
        self.tag = tag
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps(dict(op=op, **kw)) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(_REPLY):
                reply = json.loads(line[len(_REPLY):])
                if "error" in reply:
                    raise SystemExit(f"{self.tag} build, {op}: {reply['error']}")
                return reply
        raise SystemExit(f"{self.tag} build's worker ended during {op!r} (exit code {self.proc.wait()})")

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


_REPLY = "@ab@ "  # marks the worker's replies among whatever else the build prints


class Build:
    """One build's extension module and the cell it is set up for, answering the parent's
    requests: "inputs" (the cell's fresh random inputs from the given seed, and its forward),
    "outputs" (saved to a file), "time" (do_bench's median, ms) and "device"."""

    def __init__(self, path: Path, tag: str, shared_inputs: dict = None):
        self.mod = load(Path(path), tag)
        self.state = {}
        # One process: both builds take the cell's tensors from this dict (the first to ask makes them).
        self.shared_inputs = shared_inputs

    def handle(self, req: dict) -> dict:
        import torch
        from triton.testing import do_bench

        mod, state = self.mod, self.state
        reply = {}
        try:
            if req["op"] == "inputs":
                d, causal, s, mode = req["cell"]
                dtype = torch.bfloat16 if req["dtype"] == "bf16" else torch.float16
                key = (req["seed"], tuple(req["cell"]))
                if self.shared_inputs is not None and self.shared_inputs.get("key") == key:
                    q, k, v, dout = self.shared_inputs["tensors"]
                else:
                    gen = torch.Generator(device="cuda")
                    gen.manual_seed(req["seed"])  # the same seed for both builds: the same inputs
                    q, k, v, dout = make_inputs(torch, d, s, req["tokens"], req["width"], dtype, mode, gen,
                                                req["group"])[2:]
                    if self.shared_inputs is not None:
                        self.shared_inputs.update(key=key, tensors=(q, k, v, dout))
                scale = d ** -0.5
                fwd = fwd_call(mod, q, k, v, scale, causal)
                if mode == "fwd":
                    fn = lambda: fwd_call(mod, q, k, v, scale, causal)  # noqa: E731
                else:
                    fn = lambda: bwd_call(mod, dout, q, k, v, *fwd, scale, causal)  # noqa: E731
                self.state = dict(fn=fn, fwd=fwd, mode=mode, rep_ms=req["rep_ms"])
            elif req["op"] == "outputs":
                saved = {"O": state["fwd"][0], "LSE": state["fwd"][1]}
                if state["mode"] == "bwd":
                    saved.update(zip(("dQ", "dK", "dV"), state["fn"]()))
                torch.save({name: t.cpu() for name, t in saved.items()}, req["file"])
            elif req["op"] == "time":
                reply["ms"] = do_bench(state["fn"], warmup=10, rep=state["rep_ms"], return_mode="median")
            elif req["op"] == "kernels":
                from torch.profiler import ProfilerActivity, profile

                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    state["fn"]()
                    torch.cuda.synchronize()
                reply["names"] = sorted({e.name for e in prof.events()
                                         if e.device_type == torch.autograd.DeviceType.CUDA})
            elif req["op"] == "device":
                reply["name"] = torch.cuda.get_device_name()
        except Exception as exc:  # reported to the parent, which stops with it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        return reply


def serve(path: str) -> None:
    """The worker: loads one build and answers the parent's requests until its stdin closes."""
    build = Build(Path(path), "worker")
    for line in sys.stdin:
        print(_REPLY + json.dumps(build.handle(json.loads(line))), flush=True)


class InProcess:
    """A build loaded into the parent process (``--one-process``), asked as a Worker is."""

    shared_inputs: dict = {}  # the cell's tensors, made once for both builds

    def __init__(self, path: Path, tag: str):
        self.tag = tag
        self.build = Build(path, tag, InProcess.shared_inputs)

    def ask(self, op: str, **kw) -> dict:
        reply = self.build.handle(dict(op=op, **kw))
        if "error" in reply:
            raise SystemExit(f"{self.tag} build, {op}: {reply['error']}")
        return reply

    def close(self):
        pass


def paired_times(torch, fns, rep_ms: float, warmup: int = 5):
    """One process: the builds' calls alternate call by call in one loop (base, new, base, new,
    ...), each after the L2 is flushed and timed by its own CUDA events; the median per build (ms).
    The GPU's clock moves by several percent within tens of milliseconds under load, which a
    window per build (do_bench's) lets fall on one build; alternating each call spreads it over
    both."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in fns:
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    reps = max(5, min(1000, int(rep_ms / max(start.elapsed_time(end), 1e-3))))  # one turn of every build
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in fns]
    for i in range(reps):
        for j, fn in enumerate(fns):
            flush.zero_()
            events[j][i][0].record()
            fn()
            events[j][i][1].record()
    torch.cuda.synchronize()
    return [statistics.median(a.elapsed_time(b) for a, b in ev) for ev in events]


def check_namespace(tag: str, namespace: str, names) -> None:
    """One process: every flash_cuda kernel a build launched must be its own (its namespace's)."""
    ours = [n for n in names if f"{namespace}::" in n]
    others = [n for n in names if "flash_cuda" in n and f"{namespace}::" not in n]
    if others or not ours:
        raise SystemExit(f"{tag} build: its call launched {others or names} instead of kernels in namespace "
                         f"{namespace} (a tree whose build predates FLASH_CUDA_NAMESPACE cannot run --one-process)")


def compare(torch, base: dict, new: dict) -> str:
    """Forward outputs bit for bit; gradients (dQ is summed by atomics in a varying order) by
    their relative difference where not equal."""
    parts = [f"{name} {'bitwise equal' if torch.equal(base[name], new[name]) else 'DIFFERS'}"
             for name in ("O", "LSE")]
    text = ", ".join(parts)
    grads = []
    for name in ("dQ", "dK", "dV"):
        if name in base:
            a, c = base[name].float(), new[name].float()
            grads.append(f"{name} equal" if torch.equal(a, c) else
                         f"{name} rel {((a - c).norm() / a.norm().clamp_min(1e-30)).item():.1e}")
    return text + ("; " + ", ".join(grads) if grads else "")


def cells(args):
    for d in args.d:
        for causal in args.causal:
            for s in args.s:
                for mode in args.mode:
                    yield d, causal, s, mode


def make_inputs(torch, d, s, tokens, width, dtype, mode, gen, group=1):
    b, h = max(1, tokens // s), max(1, width // d)
    shape = (b, h, s, d)
    kv_shape = (b, max(1, h // group), s, d)  # group query heads per KV head (GQA)
    q = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    dout = torch.randn(shape, device="cuda", dtype=dtype, generator=gen) if mode == "bwd" else None
    return b, h, q, k, v, dout


def fwd_call(mod, q, k, v, scale, causal):
    return mod.fwd(q, k, v, scale, -1, 0 if causal else -1, 0.0, None, None, None, 0, 0, 0)


def bwd_call(mod, dout, q, k, v, out, lse, aux, scale, causal):
    return mod.bwd(dout, q, k, v, out, lse, aux, None, scale, -1, 0 if causal else -1, 0.0, None, None, None,
                   0, 0, False, 0)


def flops(b, h, s, d, causal, mode):
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * (2.5 if mode == "bwd" else 1.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="the base source checkout")
    ap.add_argument("--new", type=Path, default=Path("."), help="the changed checkout (default: .)")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/flash_cuda_ab"),
                    help="where the two builds go (a folder per tree)")
    ap.add_argument("--new-cache", type=Path, default=None,
                    help="the new tree's build cache (default: FLASH_CUDA_CACHE_DIR or ~/.cache/flash_cuda, "
                         "so that the tests reuse it)")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 96, 128, 256])
    ap.add_argument("--s", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--mode", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--tokens", type=int, default=16384, help="B * S")
    ap.add_argument("--width", type=int, default=2048, help="H * D")
    ap.add_argument("--group", type=int, default=1, help="query heads per KV head (GQA); 1: MHA")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=int, default=60, help="do_bench's timing window per measurement")
    ap.add_argument("--slices", type=int, default=1,
                    help="per cell and round, time the builds in turn this many times (each for --rep-ms); "
                         "the GPU's clock moves by several percent over tens of milliseconds, and alternating "
                         "in short slices spreads such spells over both builds (--one-process alternates "
                         "call by call within each slice)")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    ap.add_argument("--one-process", action="store_true",
                    help="load both builds into this process (same-call A/B) instead of a worker process each: "
                         "each built in a namespace and module of its own (FLASH_CUDA_NAMESPACE), the kernels "
                         "it launched checked by name, both timed call by call in one loop")
    args = ap.parse_args(argv)

    new_cache = args.new_cache or Path(os.environ.get("FLASH_CUDA_CACHE_DIR", Path.home() / ".cache" / "flash_cuda"))
    namespaces = {tag: (f"flash_cuda_ab_{tag}" if args.one_process else "") for tag in ("base", "new")}
    paths = {"base": build(args.base, args.cache / "base", namespaces["base"]),
             "new": build(args.new, new_cache, namespaces["new"])}
    print(f"builds: base {paths['base']}\n        new  {paths['new']}", flush=True)

    import torch

    make = InProcess if args.one_process else Worker
    workers = {tag: make(path, tag) for tag, path in paths.items()}
    times = {}   # (cell, tag) -> [ms, ...]
    checks = {}  # cell -> text
    all_cells = list(cells(args))
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = ("base", "new") if rnd % 2 == 0 else ("new", "base")
            for i, cell in enumerate(all_cells):
                request = dict(cell=cell, seed=rnd * len(all_cells) + i, dtype=args.dtype, tokens=args.tokens,
                               width=args.width, group=args.group, rep_ms=args.rep_ms)
                for tag in order:
                    workers[tag].ask("inputs", **request)
                if rnd == 0 and args.one_process:
                    for tag in order:
                        check_namespace(tag, namespaces[tag], workers[tag].ask("kernels")["names"])
                if rnd == 0:
                    files = {tag: os.path.join(tmp, f"{tag}.pt") for tag in order}
                    for tag in order:
                        workers[tag].ask("outputs", file=files[tag])
                    checks[cell] = compare(torch, torch.load(files["base"]), torch.load(files["new"]))
                if args.one_process:  # call by call: base, new, base, new, ... in one timing loop
                    fns = [workers[tag].build.state["fn"] for tag in order]
                    for _ in range(args.slices):
                        for tag, ms in zip(order, paired_times(torch, fns, args.rep_ms)):
                            times.setdefault((cell, tag), []).append(ms)
                    continue
                for _ in range(args.slices):  # base, new, base, new, ...: a slow spell of the GPU hits both
                    for tag in order:
                        times.setdefault((cell, tag), []).append(workers[tag].ask("time")["ms"])
            print(f"round {rnd + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    device = workers["new"].ask("device")["name"]
    for w in workers.values():
        w.close()

    rows = []
    print(f"\n{args.dtype}, B*S = {args.tokens}, H*D = {args.width}, {args.group} query heads per KV head, "
          f"{args.rounds} interleaved rounds of {args.slices} alternating slices, {'one process' if args.one_process else 'a worker process per build'}, "
          f"{device}; new / base speed (above 1: new faster)")
    print("| D | causal | S | mode | base ms | new ms | new/base | TFLOPS (new) | outputs |")
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for cell in all_cells:
        d, causal, s, mode = cell
        tb, tn = statistics.median(times[(cell, "base")]), statistics.median(times[(cell, "new")])
        b, h = max(1, args.tokens // s), max(1, args.width // d)
        tf = flops(b, h, s, d, causal, mode) / (tn * 1e-3) / 1e12
        ratio = tb / tn
        rows.append({"d": d, "causal": causal, "s": s, "mode": mode, "base_ms": times[(cell, "base")],
                     "new_ms": times[(cell, "new")], "ratio": ratio, "outputs": checks[cell]})
        print(f"| {d} | {causal} | {s} | {mode} | {tb:.4f} | {tn:.4f} | {ratio:.3f} | {tf:.0f} | {checks[cell]} |")
    ratios = sorted(r["ratio"] for r in rows)
    print(f"\n{len(rows)} cells: new/base min {ratios[0]:.3f}, median {statistics.median(ratios):.3f}, "
          f"max {ratios[-1]:.3f}; forward outputs bitwise equal in "
          f"{sum('O bitwise equal, LSE bitwise equal' in r['outputs'] for r in rows)} of {len(rows)} cells")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        serve(sys.argv[2])
    else:
        main()
