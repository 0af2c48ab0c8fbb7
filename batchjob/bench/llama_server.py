"""llama.cpp's `llama-server` as a batch peer: built from the llama-cpp-python sdist's vendored llama.cpp for this CPU
(GGML_NATIVE) and cached, run on the engine's GGUF (or on it requantized with `llama-quantize`) with N parallel slots
and continuous batching, and sent the workload's prompts as token ids, N at a time, as its HTTP clients would.

The build takes minutes (it is llama.cpp's whole CPU backend), so it is cached under the cache folder keyed on the
sdist, the CMake flags and this CPU's flags (-march=native code runs only where it was built). It holds the same kind
of build lock as the C++ kernels' build, and builds in a temporary folder renamed into place when whole."""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from batchjob import env
from batchjob.bench.measure import Result
from batchjob.bench.workloads import Workload
from batchjob.engine.host_memory import peak_rss
from batchjob.engine.outputs import Request
from batchjob.model.build_lock import build_lock
from batchjob.model.builtin import cache_dir
from batchjob.model.cpu_features import cpu_flags, cpu_kind

log = logging.getLogger(__name__)

SDIST = "llama-cpp-python"
VERSION = "0.3.36"  # pinned: its vendored llama.cpp is what the figures in docs/benchmarks.md ran
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # every instruction set this CPU has, as llama.cpp's own default build
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # binaries that run from the cache folder without their build tree's libraries
    "-DLLAMA_BUILD_TESTS=OFF",
    # Without AMX: this version's AMX matmul (ggml-cpu/amx) faults at its first tile load (ldtilecfg) on a Xeon with
    # AMX, the server dying as it warms up; with these it takes AVX-512 and VNNI there (no-ops on CPUs without AMX).
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
)
# BATCHJOB_CPU_ISA=avx2 (an AVX2-only host emulated): llama.cpp built for such a CPU too, not -march=native.
ISA_CMAKE_FLAGS = {
    "avx2": (
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON",
    ),
}
TARGETS = ("llama-server", "llama-quantize")
BUILD_JOBS = 2
_NICE = ("nice", "-n", "10")  # the build shares the host with whatever else runs
BUILD_WAIT_S = 3600.0  # another process's build: minutes on a busy two-core host
START_WAIT_S = 120.0  # for the server to load the model and answer /health
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K", "Q4_K_M", "BF16", "F16")  # for --requantize


def cmake_flags() -> tuple[str, ...]:
    """CMAKE_FLAGS, or under BATCHJOB_CPU_ISA its ISA's in place of GGML_NATIVE."""
    isa = env.cpu_isa()
    if isa is None:
        return CMAKE_FLAGS
    return tuple(f for f in CMAKE_FLAGS if not f.startswith("-DGGML_NATIVE=")) + ISA_CMAKE_FLAGS[isa]


def build_label() -> str:
    """How the binaries were built, for a report: GGML_NATIVE, or the ISA they were held to."""
    isa = env.cpu_isa()
    return "GGML_NATIVE" if isa is None else f"built for {isa.upper()}"


def build_folder() -> Path:
    """Where the binaries of this sdist, flags and CPU are (or will be) cached: the CPU by its flags and its model,
    since -march=native reads more of the CPU than /proc/cpuinfo's flags name."""
    kind = cpu_kind()
    cpu = [cpu_flags(), kind["vendor"], kind["model_name"], str(kind["family"]), str(kind["model"])]
    parts = [SDIST, VERSION, SDIST_SHA256, *cmake_flags(), *TARGETS, *cpu]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
    return cache_dir() / "llama-cpp" / f"{VERSION}-{key}"


def cached_binary(name: str = "llama-server") -> Path | None:
    """The cached build's binary, or None where it is not built yet."""
    path = build_folder() / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def ensure_built() -> Path:
    """The folder holding llama-server and llama-quantize, built first where it is not cached (minutes)."""
    folder = build_folder()
    if all((folder / t).is_file() for t in TARGETS):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(folder.parent / f"{folder.name}.lock", BUILD_WAIT_S, "llama.cpp's llama-server"):
        if not all((folder / t).is_file() for t in TARGETS):  # else another process built it while this one waited
            _build(folder)
    return folder


def _build(folder: Path) -> None:
    log.warning(
        "building llama.cpp's %s from the %s %s sdist into %s (minutes)", ", ".join(TARGETS), SDIST, VERSION, folder
    )
    for stale in folder.parent.glob(f"{folder.name}.tmp-*"):  # under the lock: a killed build's
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp-", dir=folder.parent))
    try:
        src = unpacked_sdist(tmp)
        build = tmp / "build"
        check_run([*_NICE, "cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *cmake_flags()], tmp)
        check_run([*_NICE, "cmake", "--build", str(build), "--target", *TARGETS, "-j", str(BUILD_JOBS)], tmp)
        out = tmp / "bin"
        out.mkdir()
        for t in TARGETS:
            shutil.copy2(build / "bin" / t, out / t)
        (out / "build.json").write_text(json.dumps({"sdist": f"{SDIST}=={VERSION}", "cmake": cmake_flags()}, indent=2))
        out.chmod(0o755)
        shutil.rmtree(folder, ignore_errors=True)  # a folder missing a binary: rename needs it gone
        out.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def unpacked_sdist(tmp: Path) -> Path:
    """The sdist, fetched by pip (its index settings apply) and checked against the pinned digest, unpacked; its
    vendored llama.cpp folder is returned."""
    dl = tmp / "sdist"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dl)]
    check_run([*pip, f"{SDIST}=={VERSION}"], tmp)
    (archive,) = dl.glob("*.tar.gz")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{archive.name}: sha256 {digest}, not the pinned {SDIST_SHA256}")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "src", filter="data")
    (top,) = (tmp / "src").iterdir()
    src = top / "vendor" / "llama.cpp"
    # A git submodule's pointer file to a .git folder the sdist lacks: llama.cpp's CMake runs git on it and fails.
    (src / ".git").unlink(missing_ok=True)
    return src


def check_run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed with exit code {done.returncode}:\n{tail}")


def weight_types(gguf_path: Path) -> str:
    """The GGUF's quantization of its matrices, most tensors first (e.g. 'Q4_1, Q6_K'); norms and biases, which
    every format keeps in F32, are left out unless nothing else is there."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    counts = collections.Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return ", ".join(name for name, _ in counts.most_common()) or "F32"


def requantized(gguf_path: Path, quant_type: str) -> Path:
    """The GGUF requantized to `quant_type` by the built llama-quantize, cached beside nothing else: its name keys it
    on the source's digest. From a quantized source the result keeps the source's rounding error as well."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"requantize: {quant_type!r} is not one of {', '.join(QUANT_TYPES)}")
    quantize = ensure_built() / "llama-quantize"
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()[:12]
    out = cache_dir() / "llama-cpp" / "gguf" / f"{gguf_path.stem}-{digest}.{quant_type}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        cmd = [str(quantize), "--allow-requantize", str(gguf_path), str(tmp), quant_type, "2"]
        check_run([*_NICE, *cmd], out.parent)
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def server_command(binary: Path, gguf_path: Path, port: int, slots: int, threads: int, ctx: int) -> list[str]:
    """llama-server with `slots` parallel slots under continuous batching, each slot a KV cache of `ctx / slots`
    tokens, `threads` threads for prompts and decode alike. Not -kvu (one pool that all slots share, as the engine's
    paged pool): with it, 64 slots of 256 + 64 tokens ran 2.7x slower (190 s against 70 s on one host, one run)."""
    return [
        str(binary),
        "-m",
        str(gguf_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-cb",
        "-c",
        str(ctx),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--no-webui",
    ]


def context_size(wl: Workload, slots: int) -> int:
    """KV caches for `slots` of the workload's longest requests: each slot's share holds any request."""
    longest = max(len(r.prompt_token_ids) + r.params.max_tokens for r in wl.requests)
    return slots * longest


def completion_body(r: Request) -> dict:
    """The /completion request of one workload request: its token ids as they are (no BOS added), greedy, its
    max_tokens and EOS rule, every generated token id returned."""
    return {
        "prompt": r.prompt_token_ids,
        "n_predict": r.params.max_tokens,
        "ignore_eos": r.params.ignore_eos,
        "temperature": 0.0,
        "top_k": 1,
        "return_tokens": True,
        "stream": False,
    }


@dataclass
class Completion:
    """What the server said it did for one request."""

    prompt_tokens: int  # tokens_evaluated: the prompt as the server took it
    output_tokens: int  # tokens_predicted
    token_ids: list[int]


def parse_completion(body: dict) -> Completion:
    return Completion(int(body["tokens_evaluated"]), int(body["tokens_predicted"]), list(body.get("tokens", [])))


@dataclass
class LlamaServer:
    """A running llama-server: `url` answers; `stop()` ends it."""

    process: subprocess.Popen
    url: str
    log_path: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_server(binary: Path, gguf_path: Path, slots: int, threads: int, ctx: int, log_dir: str) -> LlamaServer:
    """Start llama-server, its output to a file in `log_dir`, and wait until its /health says the model is loaded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = Path(log_dir) / f"llama-server-{port}.log"
    # OpenMP at llama.cpp's own defaults, not the ones this process set for torch (as vLLM's workers get theirs)
    own = {k: v for k, v in os.environ.items() if k not in env.set_here()}
    with open(log_path, "w") as out:
        cmd = server_command(binary, gguf_path, port, slots, threads, ctx)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=own)
    server = LlamaServer(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + START_WAIT_S
    while True:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"llama-server exited with code {proc.returncode} while starting:\n{tail}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while the model loads
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"llama-server did not answer /health within {START_WAIT_S:g} s (log: {log_path})")
        time.sleep(0.2)


def complete(url: str, r: Request) -> Completion:
    req = urllib.request.Request(
        f"{url}/completion", json.dumps(completion_body(r)).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=3600) as resp:
        return parse_completion(json.load(resp))


def run_llama_server(binary: Path, gguf_path: Path, wl: Workload, slots: int, threads: int, weights: str) -> Result:
    """The workload through a fresh llama-server (each run starts cold, as the engine's, with no prompt cached), its
    `slots` slots kept full: `slots` clients each send their next request as their last one returns. Prompt and
    output tokens are the server's counts."""
    with tempfile.TemporaryDirectory(prefix="batchjob-llama-server-") as logs:
        server = start_server(binary, gguf_path, slots, threads, context_size(wl, slots), logs)
        try:
            first = wl.requests[0]  # a warm-up request: the first one pays for allocations
            warm_up = first.params.model_copy(update={"max_tokens": 2})
            complete(server.url, Request("warm-up", first.prompt_token_ids[:8], warm_up))
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=slots) as pool:
                done = list(pool.map(lambda r: complete(server.url, r), wl.requests))
            wall = time.perf_counter() - t0
            rss = peak_rss(server.process.pid)
        finally:
            server.stop()
    result = Result(
        "llama-server",
        wall,
        sum(c.prompt_tokens for c in done),
        sum(c.output_tokens for c in done),
        len(wl.requests),
        max_batch=min(slots, len(wl.requests)),
    )
    result.outputs = {r.request_id: c.token_ids for r, c in zip(wl.requests, done)}
    result.peak_rss = rss
    result.note = f"llama.cpp ({SDIST} {VERSION}, {build_label()}) {slots} slots, -cb, {threads} threads; {weights}"
    return result
