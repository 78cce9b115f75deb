"""A calibration directory: card.json and where it lives (explicit, bundled, per-user cache).

Lookup for a model (find_calibration): an explicit --calibration DIR, then the bundled
``calibrations/<gguf stem>/`` of this repository (fixtures), then the per-user cache
``~/.cache/edgemoe/calibration/<model sha256[:16]>/`` (where `calibrate` writes by default).
Also the JSON writer the stages use for their files (atomic, compact number lists).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import EdgeMoeError
from ..paths import cache_dir

if TYPE_CHECKING:
    from ..predictors import Predictor

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CARD = "card.json"
REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_DIR = REPO_ROOT / "calibrations"  # committed calibrations of the fixture models


class CalibrationError(EdgeMoeError):
    """Calibration data is missing, incomplete, for another model, or cannot be written."""


# -- where calibration data lives ------------------------------------------------------------
def model_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a model file, read in 4 MiB chunks; remembered per (path, size, mtime) in the cache."""
    p = Path(path).resolve()
    st = p.stat()
    key = str(p)
    index_path = cache_dir() / "hashes.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    hit = index.get(key)
    if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
        return str(hit["sha256"])
    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    index[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    with contextlib.suppress(OSError):  # a read-only cache only costs a re-hash next time
        write_json(index_path, index)
    return digest


def default_out_dir(model: str | os.PathLike[str]) -> Path:
    """The per-user cache directory for this model file's calibration."""
    return cache_dir() / "calibration" / model_sha256(model)[:16]


def bundled_dir(model: str | os.PathLike[str]) -> Path:
    """calibrations/<gguf file stem>/ in this repository (committed for the fixture models)."""
    name = Path(model).name
    return BUNDLED_DIR / (name.removesuffix(".gguf"))


_SCALAR_LIST = re.compile(r"\[\s*([^\[\]{}]*?)\s*\]", re.DOTALL)


def dumps(obj: Any) -> str:
    """Indented JSON with lists of numbers/strings kept on one line (per-layer arrays, byte ranges)."""
    text = json.dumps(obj, indent=1)
    return _SCALAR_LIST.sub(lambda m: "[" + re.sub(r"\s*\n\s*", " ", m.group(1)) + "]", text)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (a temp file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(dumps(obj) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def edgemoe_commit() -> dict[str, Any]:
    """The git commit of this edgemoe checkout (None when not run from one) and whether it is dirty."""
    if not (REPO_ROOT / ".git").exists():
        return {"version": __version__, "commit": None, "dirty": None}
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            != ""
        )
    except (OSError, subprocess.SubprocessError):
        return {"version": __version__, "commit": None, "dirty": None}
    return {"version": __version__, "commit": head, "dirty": dirty}


# -- a calibration directory -------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    path: Path
    card: Mapping[str, Any]
    source: str = "explicit"  # explicit | bundled | cache

    @classmethod
    def load(cls, path: str | os.PathLike[str], source: str = "explicit") -> Calibration:
        p = Path(path)
        try:
            card = json.loads((p / CARD).read_text())
        except FileNotFoundError:
            raise CalibrationError(
                f"{p} is not a calibration directory (no {CARD}): run "
                "`edgemoe calibrate MODEL --corpus FILE --out DIR`"
            ) from None
        except (OSError, ValueError) as err:
            raise CalibrationError(f"cannot read {p / CARD}: {err}; run `edgemoe calibrate` again") from err
        if card.get("format") != FORMAT_VERSION:
            raise CalibrationError(
                f"{p / CARD} has format {card.get('format')}, this edgemoe reads "
                f"{FORMAT_VERSION}: run `edgemoe calibrate` again"
            )
        return cls(path=p, card=card, source=source)

    def stage(self, name: str) -> Mapping[str, Any]:
        if name not in self.card:
            raise CalibrationError(
                f"{self.path} has no {name!r} calibration (stages: {self.card.get('stages')}); "
                f"run `edgemoe calibrate` with the {name} stage"
            )
        return self.card[name]  # type: ignore[no-any-return]

    def check_model(self, model: str | os.PathLike[str]) -> None:
        """Raise when the card's model has another shape; warn when only the file differs."""
        from ..gguf.info import read_model_info

        info = read_model_info(Path(model))
        m = self.card.get("model", {})
        want = {
            "layers": list(info.moe_layers),
            "n_expert": info.n_expert,
            "n_expert_used": info.n_expert_used,
            "n_embd": info.n_embd,
        }
        diff = {k: (m.get(k), v) for k, v in want.items() if m.get(k) != v}
        if diff:
            raise CalibrationError(
                f"{self.path} was calibrated for another model ({m.get('file')}): "
                f"{', '.join(f'{k} {a} != {b}' for k, (a, b) in diff.items())}; "
                f"run `edgemoe calibrate {model}`"
            )
        if m.get("sha256") != model_sha256(model):
            log.warning(
                "%s was calibrated on %s (another file with the same shape); predictions may be off",
                self.path,
                m.get("file"),
            )

    def predictors(
        self,
        model: str | os.PathLike[str],
        *,
        kinds: Sequence[str] | None = None,
        distances: Sequence[int] | None = None,
    ) -> list[Predictor]:
        from ..predictors import load_predictors, spec_for_model

        entries = self.stage("predictors").get("files", [])
        return load_predictors(self.path, entries, spec_for_model(model), kinds=kinds, distances=distances)


def find_calibration(
    model: str | os.PathLike[str], explicit: str | os.PathLike[str] | None = None
) -> Calibration:
    """--calibration DIR, else the bundled calibrations/<stem>/ (same model file), else the per-user cache."""
    if explicit is not None:
        cal = Calibration.load(explicit, "explicit")
        cal.check_model(model)
        return cal
    sha = model_sha256(model)
    bundled = bundled_dir(model)
    if (bundled / CARD).is_file():
        cal = Calibration.load(bundled, "bundled")
        if cal.card.get("model", {}).get("sha256") == sha:
            return cal
        log.warning("ignoring %s: it was calibrated for another file named %s", bundled, Path(model).name)
    cached = cache_dir() / "calibration" / sha[:16]
    if (cached / CARD).is_file():
        return Calibration.load(cached, "cache")
    raise CalibrationError(
        f"no calibration data for {Path(model).name} (looked in {bundled} and {cached}): run "
        f"`edgemoe calibrate {model} --corpus FILE` or pass its directory as `calibration`"
    )
