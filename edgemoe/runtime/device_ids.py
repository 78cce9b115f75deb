"""How each device's mul_mat_id / add_id get the skipped slots of an id row: "raw" or "fill".

Every feature that leaves an expert out of a branch (a cache miss, a resident expert, a gate's or a hook's drop)
marks it with id -1. The CPU's kernels skip it. A device's kernels are proven to skip it only by running the
series' id-row cases of test-backend-ops (MUL_MAT_ID_SKIP, ADD_ID_SKIP: 1 to 512 tokens, F16 and quantized,
broadcast and per-slot src1, some ids, whole rows or nothing skipped) on that device against the CPU.

- raw: the device gets the -1 ids as they are (no host round trip);
- fill: each -1 becomes a spare row of the tensor on the CPU and the device masks its output (a round trip per
  device branch and layer): the safe mode for a device that has not proven raw.

The self-test runs once per device and build of the library, in a child process (a crash or a hang there is a
"fill", never a crash of the engine), and is recorded beside the calibrations (`cache_dir()/device-ids.json`).
EDGEMOE_DEVICE_IDS=raw|fill (or LoadConfig.device_ids) overrides it for every device.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from ..errors import InvalidConfigError
from ..paths import cache_dir
from . import native
from .config import DEVICE_IDS_SETTINGS, DeviceIdsSetting
from .op_tests import ID_ROW_CASES, OpTestError, run_series_cases

log = logging.getLogger(__name__)

DEVICE_IDS_ENV = "EDGEMOE_DEVICE_IDS"
RECORDS_NAME = "device-ids.json"
# a device's id-row cases take a few seconds on a GPU; a server that serves another client never answers
SELFTEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DeviceIdsChoice:
    """The mode one device runs with, and why."""

    device: str  # ggml's device name (CUDA0, RPC0)
    description: str  # the device's description (the GPU's name)
    raw: bool  # skipped ids reach its kernels as -1
    source: Literal["self-test", "recorded", "override"]
    note: str = ""  # one line: what the self-test found where it chose fill
    handle: int = 0  # ggml_backend_dev_t, in this process

    @property
    def mode(self) -> Literal["raw", "fill"]:
        return "raw" if self.raw else "fill"

    def line(self) -> str:
        """One line for logs and doctor: "CUDA0 (NVIDIA H100): raw, self-test"."""
        text = f"{self.device} ({self.description}): {self.mode}, {self.source}"
        return f"{text}: {self.note}" if self.note else text


@dataclass(frozen=True)
class DeviceInfo:
    """A device other than the CPU that a graph can put experts on."""

    handle: int  # ggml_backend_dev_t
    name: str
    description: str
    registry: str  # "CUDA", "RPC[127.0.0.1:50052]", ...

    @property
    def rpc_endpoint(self) -> str | None:
        """HOST:PORT of an RPC device's server (ggml describes an RPC device by it), None for any other device."""
        if not self.registry.startswith("RPC"):
            return None
        m = re.fullmatch(r"RPC\[(.+)\]", self.registry)
        return m.group(1) if m else self.description

    @property
    def key(self) -> str:
        """What the record of its self-test is kept under, with the build: the name and description (an RPC server's
        host without its port, which a loopback server picks anew each time)."""
        desc = self.description.rpartition(":")[0] if self.rpc_endpoint else self.description
        return f"{self.name}/{desc}"


# the self-test's outcome for one device: (raw, note)
SelfTest = Callable[[DeviceInfo], tuple[bool, str]]


def setting_from(config_value: str) -> DeviceIdsSetting:
    """The setting in force: the config's when it is not "auto", else EDGEMOE_DEVICE_IDS's, else "auto"."""
    value = config_value if config_value != "auto" else os.environ.get(DEVICE_IDS_ENV, "") or "auto"
    if value not in DEVICE_IDS_SETTINGS:
        src = "device_ids" if config_value != "auto" else DEVICE_IDS_ENV
        raise InvalidConfigError(f"{src} {value!r}: use one of {', '.join(DEVICE_IDS_SETTINGS)}")
    return value  # type: ignore[return-value]  # checked against the literal's values just above


def non_cpu_devices() -> list[DeviceInfo]:
    """The registered devices other than the CPU (GPUs, the RPC stand-in); none in a CPU-only process."""
    out = []
    for handle, props in native.devices():
        if props.type == native.GGML_BACKEND_DEVICE_TYPE_CPU:
            continue
        name = (props.name or b"").decode()
        out.append(
            DeviceInfo(handle, name, (props.description or b"").decode(), native.device_registry(handle))
        )
    return out


def build_id() -> str:
    """An id of the loaded native library build: the patch level and each shared library beside libllama by name,
    size and modification time (a rebuild changes it)."""
    lib_dir = Path(native.library_path()).parent
    h = hashlib.sha256(f"level {native.patch_level()}".encode())
    for f in sorted(lib_dir.glob("*.so*")):
        if f.is_file() and not f.is_symlink():
            st = f.stat()
            h.update(f"{f.name} {st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def records_path() -> Path:
    return cache_dir() / RECORDS_NAME


def load_records(path: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_record(path: Path, key: str, choice: DeviceIdsChoice) -> None:
    """Add one device's self-test to the records (written whole, atomically; a failure to write is logged)."""
    records = load_records(path)
    records[key] = {"raw": choice.raw, "note": choice.note, "device": choice.device}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(records, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as err:
        log.warning("could not record the id-row self-test in %s: %s", path, err)


def run_selftest(dev: DeviceInfo) -> tuple[bool, str]:
    """The series' id-row cases on the device in a child process: (True, "") when every case passed, else
    (False, what failed)."""
    try:
        run = run_series_cases(dev.name, timeout=SELFTEST_TIMEOUT_S, cases=ID_ROW_CASES, rpc=dev.rpc_endpoint)
    except OpTestError as err:
        return False, str(err)
    return True, f"{run.passed}/{run.total} id-row cases passed in {run.seconds:.1f} s"


def choose(
    devices: list[DeviceInfo],
    setting: DeviceIdsSetting,
    *,
    build: str,
    path: Path,
    selftest: SelfTest = run_selftest,
    fresh: bool = False,
) -> list[DeviceIdsChoice]:
    """Each device's mode: the setting where it is raw or fill, else the recorded self-test of this build (fresh:
    never), else a self-test now (recorded). A device that has not passed it runs fill."""
    out = []
    records = load_records(path) if setting == "auto" and not fresh else {}
    for dev in devices:
        if setting != "auto":
            out.append(
                DeviceIdsChoice(dev.name, dev.description, setting == "raw", "override", handle=dev.handle)
            )
            continue
        key = f"{build}/{dev.key}"
        rec = records.get(key)
        if isinstance(rec, dict) and isinstance(rec.get("raw"), bool):
            note = "" if rec["raw"] else str(rec.get("note", ""))
            out.append(
                DeviceIdsChoice(dev.name, dev.description, bool(rec["raw"]), "recorded", note, dev.handle)
            )
            continue
        raw, note = selftest(dev)
        choice = DeviceIdsChoice(dev.name, dev.description, raw, "self-test", "" if raw else note, dev.handle)
        save_record(path, key, choice)
        if raw:
            log.info("id rows on %s: raw (%s)", dev.name, note)
        else:
            log.warning(
                "id rows on %s: fill, a CPU round trip per device branch and layer, because the id-row self-test "
                "did not pass: %s (`edgemoe doctor` runs it again)",
                dev.name,
                note,
            )
        out.append(choice)
    return out


def resolve(config_value: str, *, fresh: bool = False) -> list[DeviceIdsChoice]:
    """The modes of this process's devices other than the CPU under a LoadConfig.device_ids value (none: []);
    fresh: run the self-tests again (doctor)."""
    devices = non_cpu_devices()
    if not devices:
        return []
    return choose(devices, setting_from(config_value), build=build_id(), path=records_path(), fresh=fresh)


def as_dicts(choices: list[DeviceIdsChoice]) -> list[dict[str, object]]:
    """The choices as JSON records (doctor, bench), without the process's device handles."""
    out: list[dict[str, object]] = []
    for c in choices:
        record: dict[str, object] = {k: v for k, v in asdict(c).items() if k != "handle"}
        record["mode"] = c.mode
        out.append(record)
    return out
