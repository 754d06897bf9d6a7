"""The run's inputs, part of its record: ``RUN/inputs.json``.

Two runs can only be expected to agree bit for bit when they read the same inputs. ``collect_inputs`` gathers
them; the driver writes the result once per run with ``write_inputs`` (atomically; a resumed run writes it again):

* the data: the sha256 of every data file (a directory: of every file in it), the digest of the loaded records
  and the data set's revision;
* the starting weights' digest (``rlrepro.repro.fingerprint.weights_digest`` of the policy before step 1, as the
  trainer computes it);
* the sha256 of the tokenizer files of the model directory (``TOKENIZER_FILE_NAMES``, those present);
* the environment variables that can change bits (every ``RLREPRO_*`` but the ones in ``INFORMATIONAL_ENV``,
  every ``NCCL_*`` but its debug output, ``CUBLAS_WORKSPACE_CONFIG``, ``PYTHONHASHSEED``, ... see
  ``BIT_ENV`` and ``BIT_ENV_PREFIXES``), and, apart, the informational ones (``CUDA_VISIBLE_DEVICES``,
  ``RLREPRO_STACK_DUMP_S``, ``RLREPRO_DEBUG``, ...), which are recorded but cannot change a bit;
* the python, torch, triton, CUDA (torch's build), rlrepro and (where installed) flashinfer versions and the GPU
  model;
* rlrepro's own code: a sha256 over the package's ``.py`` files (``code_digest``; the version string alone does not
  change with the source), with the git commit and dirty flag where the package is a git checkout (informational);
* the CPU: its model name and the vector instructions torch's CPU kernels use (``torch.backends.cpu.
  get_cpu_capability()``: AVX2, AVX512, ...). CPU runs give other bits under another one (the same code and seed:
  ``grpo_tiny``'s curve differs from step 1 between AVX512 and AVX2), so for two CPU runs it counts as bit-relevant;
  for GPU runs it is informational;
* informational, apart: the cluster the run ran on (``"cluster"``: the number of alive Ray nodes, the placement,
  and per node of the run its address, hostname, CPU/GPU count and the actors placed there). Placement never
  changes a bit, so a difference there is reported as informational only.

``compare_inputs(a, b)`` names what differs in sentences; ``input_differences`` gives the same as
:class:`InputDiff` records, each marked ``bits`` (can change bits) or not. ``rlrepro diff`` compares the two runs'
``inputs.json`` first, when both have one, and prints the differences before the record comparison, as the likely
cause of a divergence. They never change the verdict, which is the records' alone (two runs whose inputs differ may
still be identical, and the promise says many settings must not matter); ``rlrepro diff --strict-inputs`` also
exits 1 when an input that can change bits differs. ``--strict`` does not look at the inputs: a run with injected
faults (``RLREPRO_FAULTS``) is compared ``--strict`` against an undisturbed one to show that the faults changed
nothing. Runs without ``inputs.json`` (older runs) diff as before.

Nothing here imports torch at module level (``rlrepro diff`` reads inputs.json with this module alone).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .records import ReproError, atomic_write_bytes

__all__ = ["INPUTS_FILE", "INPUTS_FORMAT", "TOKENIZER_FILE_NAMES", "BIT_ENV", "BIT_ENV_PREFIXES", "INFORMATIONAL_ENV",
           "InputDiff", "collect_inputs", "write_inputs", "read_inputs", "compare_inputs", "input_differences",
           "file_sha256", "find_tokenizer_files", "enter_launch_dir", "in_launch_dir", "code_digest",
           "rlrepro_code", "uncompared_inputs", "CODE_KEY", "resumed_differences"]

INPUTS_FILE = "inputs.json"
INPUTS_FORMAT = "rlrepro.inputs.v1"
CODE_KEY = "rlrepro_code"  # inputs.json: the digest of rlrepro's own source (runs recorded before it have none)

# what a model directory's tokenizer may be made of (HF names); the chat template may live in its own file
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                        "chat_template.jinja", "chat_template.json", "generation_config.json")
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# environment variables that can change bits, besides every RLREPRO_* and NCCL_* one
BIT_ENV = ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
           "TRITON_INTERPRET", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
           # which vector instructions torch's, MKL's and oneDNN's CPU kernels use (their results differ by ISA)
           "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
BIT_ENV_PREFIXES = ("RLREPRO_", "NCCL_")
# recorded, but they cannot change a bit: where things run, debugging output, test-harness settings
INFORMATIONAL_ENV = ("CUDA_VISIBLE_DEVICES",
                     "RLREPRO_STACK_DUMP_S",   # dump stacks of a hung process every N s
                     "RLREPRO_DEBUG",          # print tracebacks of CLI errors
                     "RLREPRO_NO_REEXEC",      # its only effect, PYTHONHASHSEED, is recorded itself
                     "RLREPRO_FAULT_TRIALS",   # tests/test_faults_e2e.py: seeds to try
                     "RLREPRO_FAULT_LOG",      # tests/test_faults_e2e.py: where to log the trials
                     "RLREPRO_TEST_DELAYS",    # tests/test_pipeline.py: wall-clock sleeps, which must change nothing
                     "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")
_HEX = 12  # digits of a digest shown in a sentence


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes; of a directory: of the sorted list of (relative path, sha256) of its files."""
    path = Path(path)
    if path.is_dir():
        h = hashlib.sha256(b"rlrepro.dir_sha256.v1\0")
        for p in sorted(q for q in path.rglob("*") if q.is_file()):
            h.update(f"{p.relative_to(path).as_posix()}\0{file_sha256(p)}\n".encode())
        return h.hexdigest()
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: input file not found") from None
    return h.hexdigest()


def _named_digests(paths: Iterable[str | os.PathLike]) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> sha256, name -> path): named by file name, by the whole path where two share a name."""
    paths = [Path(p) for p in paths]
    counts: dict[str, int] = {}
    for p in paths:
        counts[p.name] = counts.get(p.name, 0) + 1
    digests, where = {}, {}
    for p in paths:
        name = p.name if counts[p.name] == 1 else str(p)
        digests[name], where[name] = file_sha256(p), str(p)
    return dict(sorted(digests.items())), dict(sorted(where.items()))


def find_tokenizer_files(model_dir: str | os.PathLike) -> list[Path]:
    """The tokenizer files present in ``model_dir`` (``TOKENIZER_FILE_NAMES`` and extra chat templates)."""
    root = Path(model_dir)
    files = [root / n for n in TOKENIZER_FILE_NAMES if (root / n).is_file()]
    extra = root / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        files += sorted(p for p in extra.iterdir() if p.is_file())
    return files


def _env(environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    bits, info = {}, {}
    for k in sorted(environ):
        if k in INFORMATIONAL_ENV:
            info[k] = environ[k]
        elif k in BIT_ENV or k.startswith(BIT_ENV_PREFIXES):
            bits[k] = environ[k]
    return bits, info


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu() -> dict[str, str | None]:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``) and torch's kernel capability."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    capability = None
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):  # pragma: no cover - torch is a dependency
        pass
    return {"model": model or platform.processor() or platform.machine() or None, "capability": capability}


def _versions_and_gpu() -> tuple[dict[str, str | None], str | None]:
    from rlrepro import __version__

    versions = {"python": platform.python_version(), "torch": None, "triton": _dist_version("triton"), "cuda": None,
                "rlrepro": __version__}
    fi = _dist_version("flashinfer-python")
    if fi is not None:  # its kernels are the fast mode's and RLREPRO_ATTENTION=fa3's: their bits follow its version
        versions["flashinfer"] = fi
    gpu = None
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return versions, gpu
    versions["torch"] = torch.__version__
    versions["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
    return versions, gpu


def code_digest(package_dir: str | os.PathLike | None = None) -> tuple[str, int]:
    """(sha256, number of files) over the ``.py`` files under ``package_dir`` (default: the rlrepro package), sorted
    by their relative path: ``sha256("rlrepro.code_sha256.v1\\0" || for each file: relative path (posix, utf-8) ||
    "\\0" || u64le(size) || bytes)``. Any change to rlrepro's source changes it; ``__pycache__`` is not read."""
    root = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parents[1]
    files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
                   if p.is_file() and "__pycache__" not in p.relative_to(root).parts)
    h = hashlib.sha256(b"rlrepro.code_sha256.v1\0")
    for rel, p in files:
        data = p.read_bytes()
        h.update(rel.encode("utf-8") + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest(), len(files)


def _git_commit(root: Path) -> str | None:
    """The commit HEAD names in ``root/.git`` (read from the files: no subprocess), or None."""
    git = root / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head or None
        ref = head[5:].strip()
        if (git / ref).is_file():
            return (git / ref).read_text().strip() or None
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split(" ", 1)[0]
    except OSError:
        pass
    return None


def _git_dirty(root: Path) -> bool | None:
    """Whether tracked files under the package differ from the commit (``git status``), None where unknown."""
    import subprocess

    try:
        proc = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                               "rlrepro"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(proc.stdout.strip()) if proc.returncode == 0 else None


def rlrepro_code(package_dir: str | os.PathLike | None = None) -> dict:
    """inputs.json's ``rlrepro_code``: ``{"sha256", "files", "git_commit", "git_dirty"}`` (the git entries None
    where the package is not in a git checkout)."""
    pkg = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parents[1]
    sha, n = code_digest(pkg)
    root = pkg.parent
    commit = _git_commit(root) if (root / ".git").exists() else None
    return {"sha256": sha, "files": n, "git_commit": commit, "git_dirty": _git_dirty(root) if commit else None}


def collect_inputs(*, data_files: Iterable[str | os.PathLike], records_digest: str | None,
                   data_revision: str | None, model_dir: str | os.PathLike,
                   tokenizer_files: Iterable[str | os.PathLike] | None = None, weights_digest: str | None,
                   environ: Mapping[str, str] | None = None,
                   eval_files: Iterable[str | os.PathLike] | None = None,
                   cluster: Mapping | None = None, code: Mapping[str, Any] | None = None) -> dict:
    """The inputs of a run, as ``inputs.json`` holds them.

    ``data_files``: the data set's local files (or directories) as loaded; ``records_digest``: the digest of the
    loaded records; ``data_revision``: the data set's revision (None when it has none); ``model_dir``: the
    starting model's directory, whose tokenizer files are hashed (``tokenizer_files`` lists them instead);
    ``weights_digest``: the starting weights' digest (the trainer's); ``environ``: default ``os.environ``;
    ``eval_files``: the held-out set's files (eval.source) when the run evaluates (the ``"eval"`` entry, absent
    otherwise); ``cluster``: where the actors ran (informational, the ``"cluster"`` entry, absent when None);
    ``code``: the user's functions by key (``{"reward.fn": fn, "env.fn": factory}``): the file each was defined in,
    with its sha256, under ``"code"`` (rlrepro's own built-ins are left out: ``rlrepro_code``, the digest of the
    package's source, covers them).
    Raises FileNotFoundError for a data or tokenizer file that is missing."""
    model_dir = Path(model_dir)
    files, paths = _named_digests(data_files)
    tok = [Path(p) for p in tokenizer_files] if tokenizer_files is not None else find_tokenizer_files(model_dir)
    tok_digests, _ = _named_digests(tok)
    bits, info = _env(os.environ if environ is None else environ)
    versions, gpu = _versions_and_gpu()
    out = {"format": INPUTS_FORMAT,
           "data": {"files": files, "paths": paths, "records_digest": records_digest, "revision": data_revision},
           "weights_digest": weights_digest,
           "tokenizer": {"model_dir": str(model_dir), "files": tok_digests},
           "env": bits, "env_informational": info,
           "versions": versions, CODE_KEY: rlrepro_code(), "gpu": gpu, "cpu": _cpu(),
           "launch_dir": os.getcwd()}  # informational: where relative paths (data.source, modules) were resolved
    if eval_files is not None:
        eval_digests, eval_paths = _named_digests(eval_files)
        out["eval"] = {"files": eval_digests, "paths": eval_paths}
    if cluster is not None:
        out["cluster"] = dict(cluster)
    user_code = _user_code(code or {})
    if user_code:
        out["code"] = user_code
    return out


def _user_code(code: Mapping[str, Any]) -> dict:
    """``{key: {"file": path, "sha256": digest}}`` for each object defined in a file outside the rlrepro package."""
    import inspect

    own = Path(__file__).resolve().parents[1]  # the rlrepro package
    out = {}
    for key, obj in sorted(code.items()):
        obj = inspect.unwrap(obj)
        if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj)):
            obj = type(obj)  # a callable object: its class's file
        try:
            path = Path(inspect.getsourcefile(obj) or "").resolve()
        except (TypeError, OSError):
            continue
        if path.is_file() and own not in path.parents:
            out[key] = {"file": str(path), "sha256": file_sha256(path)}
    return out



def write_inputs(run_dir: str | os.PathLike, inputs: Mapping) -> Path:
    """Write ``RUN/inputs.json`` atomically (readers see the old file or the new one)."""
    path = Path(run_dir) / INPUTS_FILE
    atomic_write_bytes(path, (json.dumps(inputs, indent=2, sort_keys=True) + "\n").encode())
    return path


def read_inputs(run_dir: str | os.PathLike) -> dict | None:
    """``RUN/inputs.json``, or None when the run has none (runs from before it existed). Raises ReproError for a
    file that is not a JSON object of a known format."""
    path = Path(run_dir) / INPUTS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ReproError(f"{path}: cannot read ({e})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ReproError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ReproError(f"{path}: expected a JSON object")
    if data.get("format") != INPUTS_FORMAT:
        raise ReproError(f"{path}: unknown format {data.get('format')!r} (expected {INPUTS_FORMAT!r})")
    return data


# ------------------------------------------------------------------------------------------------ comparison


@dataclass
class InputDiff:
    # data_file | data_records | data_revision | weights | eval_file | code | tokenizer_file | version |
    # rlrepro_code | gpu | cpu | env | cluster (informational)
    what: str
    key: str         # the file, variable or package name ("" where there is one of a kind)
    a: Any           # the values in run A and run B (None: absent / unset)
    b: Any
    bits: bool       # can this difference change bits?
    message: str     # the sentence compare_inputs gives


def _short(d: Any) -> str:
    return "none" if d is None else str(d)[:_HEX] + ("..." if len(str(d)) > _HEX else "")


def _file_diffs(what: str, label: str, fa: Mapping, fb: Mapping, bits: bool = True) -> list[InputDiff]:
    out = []
    for name in sorted(set(fa) | set(fb)):
        a, b = fa.get(name), fb.get(name)
        if a == b:
            continue
        if a is None or b is None:
            msg = f"{label} {name} is in {'B' if a is None else 'A'} only"
        else:
            msg = f"{label} {name} changed (sha256 {_short(a)} vs {_short(b)})"
        out.append(InputDiff(what, name, a, b, bits, msg))
    return out


def _value(v: Any) -> str:
    return "unset" if v is None else repr(v)


def resumed_differences(record: Mapping, label: str) -> list[InputDiff]:
    """The input differences a run's resumes recorded (``inputs.json``'s ``resumes``: a resume, or ``rlrepro verify
    --from-step``, with other inputs than the run's first start), as :class:`InputDiff` entries whose message says
    which run resumed where: "run B resumed at step 3 with ...". Older records have none."""
    out = []
    for entry in record.get("resumes") or []:
        step = entry.get("from_step")
        ahead = entry.get("generated_ahead") or []
        later = (f"; its rollouts of steps {ahead[0]}-{ahead[-1]} were generated before the resume (rollout."
                 f"max_staleness), so generation and scoring changed from step {ahead[-1] + 1}" if ahead else "")
        for d in entry.get("differences") or []:
            out.append(InputDiff(d.get("what", "env"), d.get("key", ""), d.get("a"), d.get("b"), bool(d.get("bits")),
                                 f"run {label} resumed at step {step} with other inputs than its first start "
                                 f"(first start vs resume): {d.get('message', '')}{later}"))
    return out


def input_differences(a: Mapping, b: Mapping) -> list[InputDiff]:
    """What differs between two runs' inputs (``collect_inputs`` dicts), A first; bit-relevant ones first."""
    out: list[InputDiff] = []
    da, db = a.get("data") or {}, b.get("data") or {}
    out += _file_diffs("data_file", "data file", da.get("files") or {}, db.get("files") or {})
    if da.get("records_digest") != db.get("records_digest"):
        out.append(InputDiff("data_records", "", da.get("records_digest"), db.get("records_digest"), True,
                             f"data records differ (digest {_short(da.get('records_digest'))} vs "
                             f"{_short(db.get('records_digest'))})"))
    if da.get("revision") != db.get("revision"):
        out.append(InputDiff("data_revision", "", da.get("revision"), db.get("revision"), True,
                             f"data revision differs: {_value(da.get('revision'))} vs {_value(db.get('revision'))}"))
    if a.get("weights_digest") != b.get("weights_digest"):
        out.append(InputDiff("weights", "", a.get("weights_digest"), b.get("weights_digest"), True,
                             f"starting weights differ (weights digest {_short(a.get('weights_digest'))} vs "
                             f"{_short(b.get('weights_digest'))})"))
    ea_, eb_ = a.get("eval") or {}, b.get("eval") or {}  # the held-out set changes eval/* metrics, not training
    out += _file_diffs("eval_file", "eval file", ea_.get("files") or {}, eb_.get("files") or {}, bits=False)
    ca, cb = a.get("code") or {}, b.get("code") or {}  # the user's reward.fn / env.fn: its code changes bits
    out += _file_diffs("code", "the code of", {k: v.get("sha256") for k, v in ca.items()},
                       {k: v.get("sha256") for k, v in cb.items()})
    ta, tb = a.get("tokenizer") or {}, b.get("tokenizer") or {}
    out += _file_diffs("tokenizer_file", "tokenizer file", ta.get("files") or {}, tb.get("files") or {})
    va, vb = a.get("versions") or {}, b.get("versions") or {}
    for name in sorted(set(va) | set(vb)):
        if va.get(name) != vb.get(name):
            note = " (its kernels run in the fast mode and with RLREPRO_ATTENTION=fa3)" if name == "flashinfer" else ""
            out.append(InputDiff("version", name, va.get(name), vb.get(name), True,
                                 f"{name} version differs: {va.get(name) or 'none'} vs {vb.get(name) or 'none'}"
                                 f"{note}"))
    out += _code_diffs(a.get(CODE_KEY), b.get(CODE_KEY))
    if a.get("gpu") != b.get("gpu"):
        out.append(InputDiff("gpu", "", a.get("gpu"), b.get("gpu"), True,
                             f"GPU differs: {a.get('gpu') or 'none'} vs {b.get('gpu') or 'none'}"))
    cpu_a, cpu_b = a.get("cpu"), b.get("cpu")
    if cpu_a is not None and cpu_b is not None:  # older runs have none: nothing to say
        cpu_runs = a.get("gpu") is None and b.get("gpu") is None  # a GPU run's numbers are the GPU's
        for key, label in (("capability", "CPU kernel capability"), ("model", "CPU")):
            if cpu_a.get(key) != cpu_b.get(key):
                note = "" if cpu_runs else " (informational for GPU runs)"
                out.append(InputDiff("cpu", key, cpu_a.get(key), cpu_b.get(key), cpu_runs,
                                     f"{label} differs: {cpu_a.get(key) or 'unknown'} vs "
                                     f"{cpu_b.get(key) or 'unknown'}{note}"))
    ca, cb = a.get("cluster"), b.get("cluster")
    if ca is not None and cb is not None and ca != cb:  # older runs have none: nothing to say
        out.append(InputDiff("cluster", "", ca, cb, False, f"cluster differs: {_cluster_words(ca)} vs "
                             f"{_cluster_words(cb)} (informational: placement cannot change bits)"))
    for field, bits in (("env", True), ("env_informational", False)):
        ea, eb = a.get(field) or {}, b.get(field) or {}
        for name in sorted(set(ea) | set(eb)):
            if ea.get(name) != eb.get(name):
                note = "" if bits else " (informational: cannot change bits)"
                out.append(InputDiff("env", name, ea.get(name), eb.get(name), bits,
                                     f"{name} differs: {_value(ea.get(name))} vs {_value(eb.get(name))}{note}"))
    return out


def _commit_words(c: Mapping) -> str:
    commit = c.get("git_commit")
    return "no git commit" if not commit else f"git {str(commit)[:_HEX]}" + (" dirty" if c.get("git_dirty") else "")


def _code_diffs(ka: Any, kb: Any) -> list[InputDiff]:
    """rlrepro's own source (``rlrepro_code``): its sha256 can change bits; the git commit alone cannot."""
    if not isinstance(ka, Mapping) or not isinstance(kb, Mapping):
        return []  # a run recorded before the entry: uncompared_inputs says so
    if ka.get("sha256") != kb.get("sha256"):
        return [InputDiff(CODE_KEY, "sha256", ka.get("sha256"), kb.get("sha256"), True,
                          f"rlrepro code differs (sha256 of its source {_short(ka.get('sha256'))} vs "
                          f"{_short(kb.get('sha256'))}; {_commit_words(ka)} vs {_commit_words(kb)})")]
    if (ka.get("git_commit"), ka.get("git_dirty")) != (kb.get("git_commit"), kb.get("git_dirty")):
        return [InputDiff(CODE_KEY, "git_commit", ka.get("git_commit"), kb.get("git_commit"), False,
                          f"rlrepro git commit differs: {_commit_words(ka)} vs {_commit_words(kb)} "
                          "(informational: the source is the same)")]
    return []


def uncompared_inputs(a: Mapping, b: Mapping) -> list[str]:
    """What of two runs' inputs could not be compared because a run did not record it (an older rlrepro): today
    rlrepro's code digest. ``rlrepro diff`` notes each; ``--strict-inputs`` fails on them."""
    missing = [r for r, x in (("A", a), ("B", b)) if not isinstance(x.get(CODE_KEY), Mapping)]
    if not missing:
        return []
    who = "either run" if len(missing) == 2 else f"run {missing[0]}"
    return [f"code digest not recorded in {who} ({INPUTS_FILE} {CODE_KEY}, written since rlrepro hashes its own "
            "source): a change to rlrepro's code cannot be ruled out"]


def _cluster_words(c: Mapping) -> str:
    nodes = c.get("nodes") or []
    where = "; ".join(f"{n.get('hostname') or n.get('address')}: {', '.join(n.get('actors') or [])}" for n in nodes)
    return f"{c.get('num_nodes')} node(s), placement {c.get('placement')} ({where})"


def compare_inputs(a: Mapping, b: Mapping) -> list[str]:
    """Sentences naming what differs between two runs' inputs, e.g. ``"data file gsm8k.jsonl changed (sha256
    ab12... vs cd34...)"``, ``"RLREPRO_ATTENTION_BWD differs: 'torch' vs unset"``, ``"torch version differs:
    2.13.0 vs 2.11.0"``; empty when they are the same."""
    return [d.message for d in input_differences(a, b)]


def enter_launch_dir(run: str) -> str:
    """``run`` as an absolute path; and when the run recorded another launch directory (``inputs.json``'s
    ``launch_dir``, where ``rlrepro train`` was started), the process moves there (said on stderr), so that
    config.yaml's relative paths (``data.source``, ``eval.source``) and ``reward.fn`` / ``env.fn`` modules next to
    them resolve as they did in the run."""
    path = Path(run).resolve()
    try:
        launch = (read_inputs(path) or {}).get("launch_dir")
    except (OSError, ValueError):
        launch = None
    if launch and Path(launch).is_dir() and Path(launch).resolve() != Path.cwd().resolve():
        print(f"rlrepro: working in the run's launch directory {launch} (its relative paths and modules resolve "
              "from there)", file=sys.stderr)
        os.chdir(launch)
        if launch not in sys.path:
            sys.path.append(launch)  # searched last, as the CLI does with the working directory
    return str(path)


@contextlib.contextmanager
def in_launch_dir(run: str):
    """:func:`enter_launch_dir` for the body of the ``with``; the working directory and ``sys.path`` are put back
    after it (a caller in the same process, such as a test, keeps its own)."""
    cwd, path = os.getcwd(), list(sys.path)
    try:
        yield enter_launch_dir(run)
    finally:
        os.chdir(cwd)
        sys.path[:] = path
