#!/usr/bin/env python3
"""The GPU harness: the checks CI cannot run, as named steps, on any machine with a CUDA GPU.

    python scripts/gpu.py [STEP ...] [--quick] [--out DIR] [--timeout SECONDS | STEP=SECONDS]...
                          [--baseline PATH] [--python PYTHON] [--dry-run]

Steps (default: all of them, always run in this order whatever order they are named in):

  build        install the project for this GPU: the pure-Python distributions editable
               (no dependencies), the native core with CUDA and NCCL, the jax-ffi module
               with CUDA. A build carried in .devbuild/ (bash scripts/build_cuda.sh on a
               machine with nvcc; JAX_FFI_CORE=1 adds the core for jax-ffi) is reused
               instead of compiling the core here.
  test         the GPU tests CI skips: the native core's CUDA kernels, the layer object,
               the device exchange and its NCCL provider, cuda-nccl, jax-ffi, jax, torch on CUDA.
  conformance  the conformance table on the GPU: cuda-nccl at EP 1 (host-synchronised and
               over the device exchange's NCCL provider), cuda-nccl at EP 2 and 4 with every
               rank on the one GPU (--device cuda-shared, the device exchange over CUDA IPC),
               jax-ffi, torch and jax at EP 1; cuda-nccl, torch and jax at EP 2 on two GPUs.
  sanitize     compute-sanitizer memcheck and racecheck on the grouped-GEMM check program
               and on the device exchange's, the kernels' and the layer's CUDA tests.
  bench        moe-ep bench at the DeepSeek-V3 per-rank shape (EP 1, 32 local experts),
               then moe-ep bench --compare against the card's baseline in bench/baselines/.

Every step is bounded in time (its default budget, or --timeout), writes the log of each of
its commands into the output folder (--out, else $OUT, else reports/gpu) as STEP-COMMAND.log,
and prints one verdict line, "STEP VERDICT SECONDS s: REASON" with VERDICT one of PASS, FAIL
or SKIP; the verdicts also go to verdicts.txt and, with the machine and the commit, to
summary.json (the commit, the GPUs, the budgets, every verdict). The REASON names each
command with its log's last line (pytest's or the suite's summary) or why it failed or
did not run, e.g. "test PASS 31.0 s: pytest-quick: 25 passed, 512 deselected in 24.7s".
A step that needs a GPU reports SKIP, with the reason, when there is none (nvidia-smi -L),
and build when there is no nvcc and no carried build; a command skips when its tool is
missing (compute-sanitizer, moe_ep_gemm_check, a baseline for this card). A pytest run
in which every test skipped is a FAIL on a GPU. tests/test_gpu_harness.py checks the
selection, budgets, verdicts and skips on CPU.
--quick runs a short variant of every step (about two minutes for build, test and
conformance together). Exit status: 0 when no step failed, 1 when one did, 2 on a usage error.

The device images have no pytest and no package registry: wheels put in .whl/ (see
docs/gpu.md) are installed into a private folder on the PYTHONPATH of every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("build", "test", "conformance", "sanitize", "bench")
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
#: the default time budget of each step, in seconds: (full, --quick)
BUDGETS: Dict[str, Tuple[float, float]] = {
    "build": (900.0, 45.0),
    "test": (1500.0, 120.0),
    "conformance": (1500.0, 75.0),
    "sanitize": (900.0, 60.0),
    "bench": (1800.0, 90.0),
}
#: issue 14's per-rank DeepSeek-V3 shape at EP 1
SHAPE = ("--hidden", "7168", "--intermediate", "2048", "--experts", "32", "--topk", "8")
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-rs")
SANITIZER = ("--target-processes", "all", "--report-api-errors", "no", "--error-exitcode", "9")


@dataclasses.dataclass(frozen=True)
class Command:
    """One command of a step: its name (the log is STEP-NAME.log), its argv, the variables
    added to the environment, and ``needs``: a check returning why it cannot run here
    (the command is then skipped with that reason) or an empty string."""

    name: str
    argv: Tuple[str, ...]
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    needs: Optional[Callable[[], str]] = None


@dataclasses.dataclass(frozen=True)
class Step:
    """A named step: ``commands(ctx)`` gives its commands for the context (full or quick);
    ``needs_gpu``: SKIP without a CUDA device; ``needs(ctx)``: why else it cannot run here
    (SKIP with that reason), or an empty string."""

    name: str
    commands: Callable[["Context"], List[Command]]
    needs_gpu: bool = True
    needs: Optional[Callable[["Context"], str]] = None


@dataclasses.dataclass
class Verdict:
    """The outcome of one step: ``status`` PASS, FAIL or SKIP, ``seconds`` its wall time,
    ``reason`` one line: what passed, what failed and how, or why it did not run."""

    step: str
    status: str
    seconds: float
    reason: str

    def line(self) -> str:
        return f"{self.step} {self.status} {self.seconds:.1f} s: {self.reason}"


@dataclasses.dataclass
class CommandResult:
    """One command run: ``rc`` its exit status (None: not started), ``timed_out``,
    ``seconds``, ``last`` the last non-empty line of its log."""

    name: str
    rc: Optional[int]
    timed_out: bool
    seconds: float
    last: str
    skipped: str = ""


@dataclasses.dataclass
class Context:
    """Where and how the steps run."""

    root: Path
    out: Path
    python: str
    quick: bool = False
    gpus: int = 0
    gpu_names: Tuple[str, ...] = ()
    gpu_problem: str = ""
    baseline: Optional[Path] = None
    env: Dict[str, str] = dataclasses.field(default_factory=dict)

    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)


# ---------------------------------------------------------------- the machine


def probe_gpus() -> Tuple[int, Tuple[str, ...], str]:
    """The CUDA devices ``nvidia-smi -L`` lists: (count, names, why none when none)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, (), "no CUDA device: nvidia-smi not found"
    try:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, (), f"no CUDA device: nvidia-smi -L failed ({exc})"
    names = tuple(re.sub(r"^GPU \d+: ", "", ln).split(" (UUID")[0].strip()
                  for ln in proc.stdout.splitlines() if ln.startswith("GPU "))
    if proc.returncode != 0 or not names:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[:1]
        return 0, (), "no CUDA device: nvidia-smi -L lists none" + (f" ({detail[0]})" if detail else "")
    return len(names), names, ""


def carried(ctx: Context, name: str) -> Optional[Path]:
    """A file of a build carried in .devbuild/, or None."""
    p = ctx.path(".devbuild", name)
    return p if p.is_file() else None


def gemm_check(ctx: Context) -> Optional[Path]:
    """The grouped-GEMM check program of a carried or local CUDA build."""
    for p in (ctx.path(".devbuild", "moe_ep_gemm_check"), ctx.path("build-cuda", "moe_ep_gemm_check")):
        if p.is_file():
            return p
    return None


def child_env(ctx: Context, extra: Mapping[str, str] = ()) -> Dict[str, str]:
    """The environment of every command: this process's, with the wheels' folder and tests/
    on PYTHONPATH, a carried native library (and then the binding's source on PYTHONPATH),
    NCCL on loopback, unbuffered output, jax not taking all GPU memory, then ``ctx.env``
    and ``extra``."""
    env = dict(os.environ)
    lib = carried(ctx, "libmoe_ep_native.so")
    # with a carried library the binding comes from the tree (no build of it here)
    native = str(ctx.path("backends", "native")) if lib is not None else ""
    paths = [p for p in (ctx.env.get("_SITE", ""), native, str(ctx.path("tests"))) if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if lib is not None:
        env.setdefault("MOE_EP_NATIVE_LIBRARY", str(lib))
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: v for k, v in ctx.env.items() if not k.startswith("_")})
    env.update(dict(extra))
    return env


def install_wheels(ctx: Context) -> str:
    """Install the wheels of .whl/ (pytest and what it needs: the device images have
    neither pytest nor a registry) into a private folder once; returns what happened."""
    wheels = sorted(ctx.path(".whl").glob("*.whl"))
    if not wheels or "_SITE" in ctx.env:
        return ""
    site = Path(tempfile.gettempdir()) / "moe-ep-gpu-site"
    proc = subprocess.run([ctx.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
                          capture_output=True, text=True)
    ctx.env["_SITE"] = str(site)
    if proc.returncode != 0:
        return f"installing .whl/ failed: {(proc.stderr or proc.stdout).strip()[-300:]}"
    return f"{len(wheels)} wheels from .whl/ in {site}"


# ---------------------------------------------------------------- running


def run_command(argv: Sequence[str], log: Path, timeout: float, env: Mapping[str, str], cwd: Path) -> Tuple[Optional[int], bool, float]:
    """Run argv with its output in ``log``, bounded by ``timeout`` seconds: on expiry the
    command's whole process group gets SIGTERM, then SIGKILL 5 s later.
    Returns (exit status, timed out, seconds)."""
    t0 = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write("$ " + shlex.join(argv) + "\n")
        fh.flush()
        try:
            proc = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, env=dict(env), cwd=str(cwd),
                                    start_new_session=True)
        except OSError as exc:
            fh.write(f"cannot start: {exc}\n")
            return 127, False, time.monotonic() - t0
        try:
            rc = proc.wait(timeout=max(timeout, 0.01))
            return rc, False, time.monotonic() - t0
        except subprocess.TimeoutExpired:
            _stop(proc)
            fh.write(f"\n[gpu.py] timed out after {timeout:.0f} s\n")
            return proc.returncode, True, time.monotonic() - t0
        except BaseException:  # Ctrl-C: the command's own session does not get it
            _stop(proc)
            raise


def _stop(proc: "subprocess.Popen[bytes]") -> None:
    """SIGTERM to the command's process group, 5 s for it to end, then SIGKILL to whatever
    of the group is left (a rank process that outlived its parent included)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        proc.wait(timeout=30.0)
    except subprocess.TimeoutExpired:
        pass


def last_line(log: Path) -> str:
    """The log's last non-empty line (a pytest or conformance summary), shortened."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    lines = [ln for ln in lines if not ln.startswith("[gpu.py]")]
    text = re.sub(r"=+", "", lines[-1]).strip() if lines else ""
    return text if len(text) <= 120 else text[:117] + "..."


def run_step(step: Step, ctx: Context, budget: float) -> Verdict:
    """Run one step's commands in order within ``budget`` seconds; return its verdict."""
    t0 = time.monotonic()
    if step.needs_gpu and ctx.gpus == 0:
        return Verdict(step.name, SKIP, 0.0, ctx.gpu_problem or "no CUDA device")
    why = step.needs(ctx) if step.needs else ""
    if why:
        return Verdict(step.name, SKIP, 0.0, why)
    commands = step.commands(ctx)
    results: List[CommandResult] = []
    for i, cmd in enumerate(commands):
        why = cmd.needs() if cmd.needs else ""
        if why:
            results.append(CommandResult(cmd.name, None, False, 0.0, "", skipped=why))
            continue
        left = budget - (time.monotonic() - t0)
        if left <= 1.0:
            rest = [c.name for c in commands[i:]]
            return _verdict(step, results, t0, f"budget of {budget:.0f} s spent; not run: {', '.join(rest)}")
        if "_SITE" not in ctx.env:
            note = install_wheels(ctx)
            if note.startswith("installing"):
                return Verdict(step.name, FAIL, time.monotonic() - t0, note)
        log = ctx.out / f"{step.name}-{cmd.name}.log"
        rc, timed_out, secs = run_command(cmd.argv, log, left, child_env(ctx, cmd.env), ctx.root)
        results.append(CommandResult(cmd.name, rc, timed_out, secs, last_line(log)))
    return _verdict(step, results, t0, "")


def _all_skipped(summary: str) -> bool:
    """A pytest summary line with tests skipped and none passed: on a GPU that is a failure
    (a CUDA build missing, a device not seen), not a pass."""
    return bool(re.search(r"\b\d+ skipped\b", summary)) and not re.search(r"\b\d+ passed\b", summary)


def _verdict(step: Step, results: List[CommandResult], t0: float, unfinished: str) -> Verdict:
    secs = time.monotonic() - t0
    failed = [r for r in results if r.skipped == "" and (r.timed_out or r.rc != 0 or _all_skipped(r.last))]
    ran = [r for r in results if r.skipped == ""]
    parts = []
    for r in results:
        if r.skipped:
            parts.append(f"{r.name} skipped ({r.skipped})")
        elif r.timed_out:
            parts.append(f"{r.name} timed out after {r.seconds:.0f} s")
        elif r.rc != 0:
            parts.append(f"{r.name} rc={r.rc}: {r.last}")
        elif _all_skipped(r.last):
            parts.append(f"{r.name}: every test skipped: {r.last}")
        else:
            parts.append(f"{r.name}: {r.last}" if r.last else f"{r.name}: ok")
    if unfinished:
        parts.append(unfinished)
    reason = "; ".join(parts) or "nothing to run"
    if failed or unfinished:
        return Verdict(step.name, FAIL, secs, reason)
    if not ran:
        return Verdict(step.name, SKIP, secs, reason)
    return Verdict(step.name, PASS, secs, reason)


# ---------------------------------------------------------------- the steps


def _py(ctx: Context, *args: str) -> Tuple[str, ...]:
    return (ctx.python, *args)


def _pytest(ctx: Context, *args: str) -> Tuple[str, ...]:
    return (ctx.python, *PYTEST, *args)


def _cli(ctx: Context, *args: str) -> Tuple[str, ...]:
    return (ctx.python, "-m", "moe_ep_spec.cli", *args)


def _needs_nvcc() -> str:
    return "" if shutil.which("nvcc") else "nvcc not found"


def build_needs(ctx: Context) -> str:
    if carried(ctx, "libmoe_ep_native.so") is None and not shutil.which("nvcc"):
        return "nvcc not found and no build carried in .devbuild/ (bash scripts/build_cuda.sh makes one)"
    return ""


def build_commands(ctx: Context) -> List[Command]:
    pip = ("-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps")
    cmds = [Command("python-packages", _py(ctx, *pip, "-e", ".", "-e", "./conformance", "-e", "./bench",
                                            "-e", "./backends/torch", "-e", "./backends/cuda_nccl"))]
    if carried(ctx, "libmoe_ep_native.so") is None:
        cmds.append(Command("native", _py(ctx, *pip, "-e", "./backends/native"),
                            env={"MOE_EP_NATIVE_CUDA": "1", "MOE_EP_NATIVE_NCCL": "1", "MOE_EP_CUDA_ARCHS": "90a"},
                            needs=_needs_nvcc))
    cmds.append(Command("native-info", _py(ctx, "-c", "import moe_ep_native as m; print(m.build_info(), '| nccl:', m.has_nccl())")))
    if not ctx.quick:
        env = {"MOE_EP_NATIVE_CUDA": "ON", "MOE_EP_CUDA_ARCHS": "90a"}
        core = carried(ctx, "libmoe_ep_native_core.a")
        if core is not None:
            env["MOE_EP_NATIVE_CORE_LIBRARY"] = str(core)
        elif ctx.path(".devbuild", "cutlass", "include", "cutlass", "cutlass.h").is_file():
            env["CUTLASS_DIR"] = str(ctx.path(".devbuild", "cutlass"))  # compile the core here, with carried CUTLASS
        cmds.append(Command("jax-ffi", _py(ctx, *pip, "-e", "./backends/jax", "-e", "./backends/jax_ffi"), env=env,
                            needs=_needs_nvcc))
    return cmds


QUICK_TESTS = ("(test_native_cuda and (formats_cuda_equal_cpu or permute_and_combine or nan_token)) "
               "or (test_cuda_loopback_device_exchange and ep1 and throughput) "
               "or test_cuda_static_mode_matches_the_synced_mode[1] "
               "or test_cuda_bf16_backward_follows_the_formulas or test_cuda_module_paths_and_main_grad")


def test_commands(ctx: Context) -> List[Command]:
    if ctx.quick:
        return [Command("pytest-quick", _pytest(ctx, "tests/test_native_cuda.py", "tests/test_native_exchange.py",
                                                "tests/test_cuda_nccl.py", "tests/test_native_bf16_backward.py",
                                                "-k", QUICK_TESTS))]
    return [
        Command("native", _pytest(ctx, "tests/test_native_cuda.py", "tests/test_native_decode_bf16.py",
                                  "tests/test_native_bf16_backward.py",
                                  "tests/test_native_mxfp8_weights.py", "tests/test_native_nvfp4_weights.py",
                                  "tests/test_native_layer.py", "tests/test_native.py")),
        # -m "not slow": the slow tests of these files are CPU stand-ins for what runs here on the GPU
        Command("exchange", _pytest(ctx, "-m", "not slow", "tests/test_native_exchange.py",
                                    "tests/test_native_exchange_nccl.py")),
        Command("cuda-nccl", _pytest(ctx, "-m", "not slow", "tests/test_cuda_nccl.py",
                                     "tests/test_cuda_nccl_block_scaled.py", "tests/test_cuda_nccl_device_conformance.py")),
        Command("jax-ffi", _pytest(ctx, "tests/test_jax_ffi.py", "tests/test_jax_one_rank.py")),
        Command("jax", _pytest(ctx, "tests/test_jax_backend.py")),
        Command("torch", _pytest(ctx, "tests/test_torch_backend.py", "-k", "cuda")),
    ]


#: the conformance cases of the fused layer, forward and backward (the stash cases left out)
QUICK_LAYER_CASES = "(forward or backward) and not forward_stash"


def conformance_commands(ctx: Context) -> List[Command]:
    out = ctx.out
    device = {"MOE_EP_CUDA_NCCL_EXCHANGE": "device", "MOE_EP_LOAD_PLUGINS": "reference,cuda-nccl"}
    if ctx.quick:  # the quick table's layer cases: at EP 1 over NCCL, at EP 2 (static) through the device exchange
        return [
            Command("cuda-nccl-ep1", _cli(ctx, "conformance", "--backend", "cuda-nccl", "--device", "cuda", "--ep-size", "1",
                                          "--quick", "-k", QUICK_LAYER_CASES, "--timeout", "60",
                                          "--report-md", str(out / "conformance-cuda-nccl-ep1.md"))),
            Command("cuda-nccl-shared-ep2", _cli(ctx, "conformance", "--backend", "cuda-nccl", "--device", "cuda-shared",
                                                 "--ep-size", "2", "--quick", "-k", f"({QUICK_LAYER_CASES}) and static",
                                                 "--timeout", "60",
                                                 "--report-md", str(out / "conformance-cuda-nccl-shared-ep2.md")),
                    env=device),
        ]
    cmds = [
        Command("cuda-nccl-ep1", _cli(ctx, "conformance", "--backend", "cuda-nccl", "--device", "cuda", "--ep-size", "1",
                                      "--timeout", "300", "--report-md", str(out / "conformance-cuda-nccl-ep1.md"))),
        Command("cuda-nccl-nccl-peers-ep1", _cli(ctx, "conformance", "--backend", "cuda-nccl", "--device", "cuda",
                                                 "--ep-size", "1", "--timeout", "300",
                                                 "--report-md", str(out / "conformance-cuda-nccl-nccl-peers-ep1.md")),
                env={**device, "MOE_EP_EXCHANGE_PEERS": "nccl"}),
    ]
    for mode in ("throughput", "low_latency"):
        cmds.append(Command(f"cuda-nccl-shared-{mode}", _cli(ctx, "conformance", "--backend", "cuda-nccl", "--device",
                                                            "cuda-shared", "--ep-size", "2", "--ep-size", "4", "--timeout", "120",
                                                            "--report-md", str(out / f"conformance-cuda-nccl-shared-{mode}.md")),
                            env={**device, "MOE_EP_CUDA_NCCL_EXCHANGE_MODE": mode}))
    cmds += [
        Command("jax-ffi-ep1", _cli(ctx, "conformance", "--backend", "jax-ffi", "--device", "cuda", "--ep-size", "1",
                                    "--timeout", "300", "--report-md", str(out / "conformance-jax-ffi-ep1.md"))),
    ]
    for backend in ("torch", "jax"):
        cmds.append(Command(f"{backend}-ep1", _cli(ctx, "conformance", "--backend", backend, "--device", "cuda",
                                                   "--ep-size", "1", "--timeout", "300",
                                                   "--report-md", str(out / f"conformance-{backend}-ep1.md"))))
    if ctx.gpus >= 2:  # every rank on its own GPU: NCCL over NVLink
        for backend in ("cuda-nccl", "torch", "jax"):
            cmds.append(Command(f"{backend}-ep2", _cli(ctx, "conformance", "--backend", backend, "--device", "cuda",
                                                       "--ep-size", "2", "--timeout", "300",
                                                       "--report-md", str(out / f"conformance-{backend}-ep2.md"))))
    return cmds


def sanitize_commands(ctx: Context) -> List[Command]:
    def sanitizer(tool: str, *argv: str) -> Tuple[str, ...]:
        return ("compute-sanitizer", "--tool", tool, *SANITIZER, *argv)

    def needs_sanitizer() -> str:
        return "" if shutil.which("compute-sanitizer") else "compute-sanitizer not found"

    def needs_gemm_check() -> str:
        return needs_sanitizer() or ("" if gemm_check(ctx) else "no moe_ep_gemm_check in .devbuild/ or build-cuda/")

    exchange = "tests/test_native_exchange.py"
    if ctx.quick:
        return [Command("memcheck-exchange-ep1", sanitizer("memcheck", *_pytest(
            ctx, exchange, "-k", "test_cuda_loopback_device_exchange and ep1 and throughput and slot")), needs=needs_sanitizer)]
    check = str(gemm_check(ctx) or "moe_ep_gemm_check")
    loopback = "(test_cuda_loopback and (ep1 or ep2)) or test_cuda_one_rank_plans"
    # EP 1's fused dispatch and few-token combine under every MOE_EP_ONE_RANK_FAST setting
    # (the small cases: the decode one is 128 tokens of 7168 values, minutes under the tools)
    fast = "test_cuda_one_rank_fast and (few or unaligned or aligned-repeats)"
    return [
        # every check of the grouped GEMMs, the mxfp8- and nvfp4-weights kernels' included
        Command("memcheck-gemm", sanitizer("memcheck", check, "--no-time"), needs=needs_gemm_check),
        Command("racecheck-gemm-nvfp4", sanitizer("racecheck", check, "--nvfp4-weights", "--no-time"),
                needs=needs_gemm_check),
        Command("memcheck-exchange", sanitizer("memcheck", *_pytest(ctx, exchange, "-k", f"{loopback} or ({fast})")),
                needs=needs_sanitizer),
        Command("racecheck-exchange", sanitizer("racecheck", *_pytest(
            ctx, exchange, "-k", f"(({loopback}) and throughput) or ({fast})")), needs=needs_sanitizer),
        Command("memcheck-kernels", sanitizer("memcheck", *_pytest(
            ctx, "tests/test_native_cuda.py", "-k", "plan_routes or permute or combine_reduce or experts")),
            needs=needs_sanitizer),
        # the experts stages on tensor cores: the layer's forward and backward kernels (launched with
        # programmatic dependent launch), after an exchange's dispatch too, and the block-scaled-weights
        # forward (the offsets made by FC1's blocks)
        *(Command(f"{tool}-layer", sanitizer(tool, *_pytest(
            ctx, "tests/test_native_layer.py", "tests/test_native_mxfp8_weights.py",
            "tests/test_native_nvfp4_weights.py", "-k", "cuda")), needs=needs_sanitizer)
          for tool in ("memcheck", "racecheck")),
        # the bf16-operand backward's GEMMs and fused SwiGLU pass (one forward+backward of each case)
        *(Command(f"{tool}-bf16-backward", sanitizer(tool, *_pytest(
            ctx, "tests/test_native_bf16_backward.py", "-k", "test_cuda_bf16_backward_follows_the_formulas and bf16]")),
            needs=needs_sanitizer) for tool in ("memcheck", "racecheck")),
    ]


def baseline_commands(path: Path) -> List[str]:
    """The bench command lines a baseline file was measured with: a bench report's
    ``command``, or every ``sources[].command`` of a file of bench/baselines/."""
    doc = json.loads(path.read_text())
    if "sources" in doc:
        return [str(s["command"]) for s in doc["sources"] if s.get("command")]
    return [str(doc["command"])] if doc.get("command") else []


def bench_commands(ctx: Context) -> List[Command]:
    out = ctx.out
    baseline = ctx.baseline
    if baseline is None:
        missing = f"no baseline for this card ({', '.join(ctx.gpu_names) or 'unknown'}) in bench/baselines/"
    else:
        missing = "" if baseline.is_file() else f"no baseline file {baseline}"
    compare = () if missing else ("--compare", str(baseline))
    if ctx.quick:
        args = ("--tokens", "128", "--format", "mxfp8", "--intermediate-format", "bf16", "--op", "forward",
                "--repeats", "10", "--warmup", "2")
    else:
        args = ("--tokens", "128", "--tokens", "4096", "--format", "bf16", "--format", "mxfp8", "--format", "nvfp4",
                "--intermediate-format", "bf16", "--op", "forward", "--op", "forward_backward")
    cmds = [Command("cuda-nccl", _cli(ctx, "bench", "--device", "cuda", "--ep-size", "1", "--backend", "cuda-nccl",
                                      *SHAPE, *args, *compare, "--json", str(out / "bench-cuda-nccl.json"), "--no-progress"))]
    if ctx.quick:
        return cmds
    # training as the fast stacks run it: the bf16-operand backward (issue 42's targets), on the
    # native backends and the pure jax one, the MoeEpLayer row included (the torch driver adds it)
    training = ("--tokens", "128", "--tokens", "4096", "--format", "bf16", "--intermediate-format", "bf16",
                "--op", "forward_backward", "--backward-operand-format", "bf16")
    for backend in ("cuda-nccl", "jax-ffi", "jax"):
        cmds.append(Command(f"{backend}-bf16-backward", _cli(ctx, "bench", "--device", "cuda", "--ep-size", "1",
                                                             "--backend", backend, *SHAPE, *training, "--json",
                                                             str(out / f"bench-{backend}-bf16-backward.json"),
                                                             "--no-progress")))
    if missing:
        where = str(baseline or ctx.path("bench", "baselines", "CARD.json"))
        cmds.append(Command("compare", ("moe-ep", "bench", "--compare", where), needs=lambda: missing))
        return cmds
    for i, line in enumerate(baseline_commands(baseline), 1):
        argv = shlex.split(line)
        if argv[:2] != ["moe-ep", "bench"]:
            continue
        cmds.append(Command(f"compare-{i}", _cli(ctx, *argv[1:], *compare, "--json", str(out / f"bench-compare-{i}.json"),
                                                 "--no-progress")))
    return cmds


REGISTRY: Dict[str, Step] = {
    "build": Step("build", build_commands, needs=build_needs),
    "test": Step("test", test_commands),
    "conformance": Step("conformance", conformance_commands),
    "sanitize": Step("sanitize", sanitize_commands),
    "bench": Step("bench", bench_commands),
}


def select_steps(names: Sequence[str]) -> List[str]:
    """The steps to run, in the harness's order; none named: all. Raises ValueError naming
    an unknown step and the known ones."""
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        raise ValueError(f"unknown step {', '.join(unknown)}: the steps are {', '.join(STEPS)}")
    return [s for s in STEPS if not names or s in names]


def parse_timeouts(values: Sequence[str], steps: Sequence[str], quick: bool) -> Dict[str, float]:
    """Each step's budget: its default (full or quick), or SECONDS for every step, or
    STEP=SECONDS for one. Raises ValueError on a bad value."""
    budgets = {s: BUDGETS[s][1 if quick else 0] for s in steps}
    for v in values:
        name, _, secs = v.rpartition("=")
        try:
            seconds = float(secs)
        except ValueError:
            raise ValueError(f"--timeout {v!r}: expected SECONDS or STEP=SECONDS with SECONDS a number") from None
        if seconds <= 0:
            raise ValueError(f"--timeout {v!r}: SECONDS must be positive")
        if name and name not in STEPS:
            raise ValueError(f"--timeout {v!r}: unknown step {name!r}; the steps are {', '.join(STEPS)}")
        for s in budgets:
            if not name or s == name:
                budgets[s] = seconds
    return budgets


def default_baseline(root: Path, names: Sequence[str]) -> Optional[Path]:
    """bench/baselines/<card>.json for the first GPU: h200 or h100 by its name."""
    for card in ("h200", "h100"):
        if names and card.upper() in names[0].upper():
            return root / "bench" / "baselines" / f"{card}.json"
    return None


def commit(root: Path) -> str:
    """HEAD of the checkout at ``root``; "unknown" when root is not a checkout's top (a
    snapshot such as ``git archive HEAD`` inside another checkout: not that one's HEAD)."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = proc.stdout.split()
    if proc.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != root.resolve():
        return "unknown"
    return lines[1]


def main(argv: Optional[Sequence[str]] = None, probe: Callable[[], Tuple[int, Tuple[str, ...], str]] = probe_gpus) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog="Steps: " + ", ".join(STEPS))
    p.add_argument("steps", nargs="*", metavar="STEP", help="steps to run (default all)")
    p.add_argument("--quick", action="store_true", help="the short variant of every step")
    p.add_argument("--out", help="the output folder (default $OUT, else reports/gpu)")
    p.add_argument("--timeout", action="append", default=[], metavar="[STEP=]SECONDS",
                   help="time budget of every step, or of one (repeatable)")
    p.add_argument("--baseline", help="the bench baseline to compare with (default bench/baselines/<card>.json)")
    p.add_argument("--python", default=sys.executable, help="the interpreter of the commands (default this one)")
    p.add_argument("--dry-run", action="store_true", help="print each step's commands and budget, run nothing")
    args = p.parse_args(argv)
    try:
        names = select_steps(args.steps)
        budgets = parse_timeouts(args.timeout, names, args.quick)
    except ValueError as exc:
        p.error(str(exc))
    gpus, gpu_names, problem = probe()
    out = Path(args.out or os.environ.get("OUT") or ROOT / "reports" / "gpu").resolve()
    ctx = Context(root=ROOT, out=out, python=args.python, quick=args.quick, gpus=gpus, gpu_names=gpu_names,
                  gpu_problem=problem,
                  baseline=Path(args.baseline).resolve() if args.baseline else default_baseline(ROOT, gpu_names))
    if args.dry_run:
        for n in names:
            print(f"[{n}] budget {budgets[n]:.0f} s")
            for c in REGISTRY[n].commands(ctx):
                env = " ".join(f"{k}={v}" for k, v in c.env.items())
                print(f"  {c.name}: {env + ' ' if env else ''}{shlex.join(c.argv)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    head = commit(ROOT)
    print(f"gpu.py: steps {' '.join(names)}{' (quick)' if args.quick else ''}; GPUs: "
          f"{', '.join(gpu_names) if gpus else problem}; commit {head}; logs in {out}", flush=True)
    verdicts: List[Verdict] = []
    with open(out / "verdicts.txt", "w") as fh:
        for n in names:
            v = run_step(REGISTRY[n], ctx, budgets[n])
            verdicts.append(v)
            print(v.line(), flush=True)
            fh.write(v.line() + "\n")
            fh.flush()
    counts = {s: sum(v.status == s for v in verdicts) for s in (PASS, FAIL, SKIP)}
    summary = f"summary: {counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP in {sum(v.seconds for v in verdicts):.0f} s"
    print(summary)
    (out / "summary.json").write_text(json.dumps({
        "commit": head, "quick": args.quick, "gpus": list(gpu_names), "budgets_s": budgets,
        "verdicts": [dataclasses.asdict(v) for v in verdicts], "summary": summary}, indent=2) + "\n")
    return 1 if counts[FAIL] else 0


if __name__ == "__main__":
    sys.exit(main())
