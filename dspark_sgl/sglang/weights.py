"""Live draft updates: SGLang's own weight-update endpoints reach this worker's draft, validated and swapped whole.

SGLang 0.5.23 routes `/update_weights_from_tensor`, `/update_weights_from_distributed` (after
`/init_weights_update_group`) and `/begin_weight_update` to the runners its `selector` names (`target`, `draft` or
`all`), asking each spec worker for them through `weight_update_runners()`. The builtin DSPARK/DFLASH workers answer
with a SGLang ModelRunner; ours has no draft runner (the draft is a plain torch module), so `DraftRunner` answers the
same calls. `/update_weights_from_disk` has no selector in 0.5.23 and loads every runner from the same folder: the
plugin's `route_disk_update` sends a folder that holds a DSpark draft to the draft alone (the target loader would
otherwise read draft tensors as its own) and leaves every other folder to SGLang.

An update is validated like a start-up load (same config as the serving draft except the STS temperatures, every
tensor present with its shape, floating dtype, no NaN/inf) into a complete new draft module before anything changes;
a refused update returns one message naming the problem and the old draft keeps serving. Requests for these
endpoints are handled by the scheduler between forward steps, so the swap (one reference assignment) is atomic: no
step mixes old and new weights. Tensor/distributed updates may arrive in several calls of one
begin/end session; they are staged and installed by the call that completes the set (`dspark_meta.*` tensors, if
any, must come first), and an incomplete session is dropped at `end_weight_update`.

Context K/V written by the old draft is stale after a swap; `DraftContextPool.new_epoch` marks it, and requests that
still read some verify the anchor alone (plain decoding, so output is the target's) until they finish. STS
temperatures and an SPS table travel with the draft: the folder's config/sts.json/sps.json, or `dspark_meta.sts` /
`dspark_meta.sps` tensors. Without an SPS table the engine keeps the one it measured (SPS is a property of the target
and hardware); without STS the new draft's raw confidences are used (the old temperatures were fitted to the old
draft). The release version/step (`publish.json` in the folder, or `dspark_meta.release`) shows in `/server_info`.

A pause has a lease: `/pause_generation` ends by itself `dspark_pause_lease_s` seconds later (default 60; 0 = never)
unless a `/continue_generation` or a newer pause came first. The trainer pauses around each swap (training/publish.py);
killed between its pause and its continue, it would otherwise leave the server paused for good, every request waiting.
Ending a pause early is safe: the swap is atomic whenever it arrives.

An operator may confine disk updates to one folder: `--json-model-override-args '{"dspark_draft_root": DIR}'`
(`dspark serve --draft-root DIR`). The admin key decides who may push an update; the root decides what the server
may read for one, so a leaked key (or a mistyped path) cannot make it load whatever folder the server can see.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from dspark_sgl.config import ConfigError, DSparkConfig
from dspark_sgl.model.checkpoint import CheckpointError, canonical_name, check_state_dict, read_state_dict
from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.sglang.ranks import RankSync
from dspark_sgl.speculative.sps import SpsTable

logger = logging.getLogger(__name__)
META = "dspark_meta."  # tensor-name prefix of the non-weight parts of an update
RELEASE_FILE = "publish.json"  # {"version": ..., "step": ...} written by training/publish.py
SPS_FILE = "sps.json"
TARGET_CHANGED = "target weights changed"
DRAFT_ROOT_KEY = "dspark_draft_root"  # in --json-model-override-args; `dspark serve --draft-root` sets it
PAUSE_LEASE_KEY = "dspark_pause_lease_s"  # in --json-model-override-args
PAUSE_LEASE_S = 60.0


class UpdateRefused(ValueError):
    """A draft update that would not load at start-up either."""


@dataclass
class Release:
    """A validated draft, ready to install."""

    draft: DSparkDraft
    sts: list[float] | None
    sps: SpsTable | None
    version: str | None
    step: int | None
    source: str


# ---- validation (pure torch: the unit tests run it without sglang) ------------------------------------------
def _structure(config: DSparkConfig) -> dict:
    d = config.to_dict()
    d.pop("sts_temperatures", None)
    return d


def check_config(serving: DSparkConfig, update: DSparkConfig) -> None:
    """The update must describe the serving draft exactly (STS temperatures may differ)."""
    a, b = _structure(serving), _structure(update)
    diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if diff:
        shown = ", ".join(f"{k}: serving {a.get(k)!r} vs update {b.get(k)!r}" for k in diff[:4])
        raise UpdateRefused(f"draft update config differs from the serving draft in {diff}: {shown}")


INTEGER_BUFFERS = {"d2t"}  # a reduced vocabulary's draft -> target id offsets (int64, never cast)


def check_dtypes(state: dict[str, Tensor]) -> None:
    bad = sorted(f"{k} ({t.dtype})" for k, t in state.items() if not t.is_floating_point() and k not in INTEGER_BUFFERS)
    if bad:
        raise UpdateRefused(f"draft update has non-floating tensors {bad[:6]}; weights must be float32/bf16/fp16")


def build_release(serving: DSparkDraft, config: DSparkConfig, state: dict[str, Tensor], sts: list[float] | None,
                  sps: SpsTable | None, version: str | None, step: int | None, source: str) -> Release:
    """Validate a complete update and build the new draft beside the serving one (nothing serving changes)."""
    check_config(serving.config, config)
    if sts is not None:
        if len(sts) != config.block_size or not all(float(t) > 0 for t in sts):
            raise UpdateRefused(f"STS temperatures {sts} must be {config.block_size} positive numbers")
        config.sts_temperatures = [float(t) for t in sts]
    with torch.device("meta"):
        draft = DSparkDraft(config)
    check_dtypes(state)
    try:
        check_state_dict(draft, state)
    except CheckpointError as e:
        raise UpdateRefused(str(e)) from None
    ref = serving.fc.weight
    draft.load_state_dict({k: t.to(ref.dtype) if t.is_floating_point() else t for k, t in state.items()}, assign=True)
    draft = draft.to(device=ref.device, dtype=ref.dtype).eval()
    if serving._target is not None:
        draft.bind_target(serving.target.embed_tokens, serving.target.lm_head, serving.target.hot_dtype)
    return Release(draft, config.sts_temperatures, sps, version, step, source)


def read_folder(serving: DSparkDraft, path: str | Path) -> Release:
    """An exported draft folder (config.json, *.safetensors, optional sts.json / sps.json / publish.json)."""
    folder = Path(path)
    if not folder.is_dir():
        raise UpdateRefused(f"draft update path {folder} is not a folder")
    try:
        config = DSparkConfig.from_pretrained(folder)
        state = read_state_dict(folder)
    except (ConfigError, CheckpointError, OSError, ValueError) as e:
        raise UpdateRefused(f"draft update {folder}: {e}") from None
    sts = config.sts_temperatures
    if (folder / "sts.json").exists() and sts is None:
        sts = json.loads((folder / "sts.json").read_text())["temperatures"]
    sps = SpsTable.load(folder / SPS_FILE) if (folder / SPS_FILE).exists() else None
    rel = json.loads((folder / RELEASE_FILE).read_text()) if (folder / RELEASE_FILE).exists() else {}
    return build_release(serving, config, state, sts, sps, rel.get("version"), rel.get("step"), f"disk:{folder}")


def inside_draft_root(path: str | Path, root: str | Path) -> Path:
    """The update folder with every symlink and `..` resolved, if it lies inside `root`; else UpdateRefused.

    Resolving first (strict: the folder must exist) is what makes the check hold: a link inside the root that
    points out of it, or a `root/../elsewhere`, is judged by where it really leads. The caller loads the resolved
    path, so the folder judged is the folder read."""
    try:
        real_root = Path(root).resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise UpdateRefused(f"the draft root {root} ({DRAFT_ROOT_KEY}) does not exist: {e}") from None
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError) as e:  # missing, unreadable, or a symlink loop
        raise UpdateRefused(f"update path {path} does not exist or cannot be resolved: {e}") from None
    if not real.is_relative_to(real_root):
        raise UpdateRefused(f"update path {path} resolves to {real}, outside the draft root {real_root} "
                            f"({DRAFT_ROOT_KEY}); only folders inside it may be loaded")
    return real


def draft_root() -> str | None:
    """The operator's draft root from the server's --json-model-override-args (None: disk updates unconfined)."""
    from dspark_sgl.sglang.args import override_arg

    return override_arg(DRAFT_ROOT_KEY)


def is_draft_folder(path: str | Path) -> bool:
    """A folder whose config.json describes a DSpark/DFlash draft (not a target model)."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    archs = " ".join(raw.get("architectures") or [])
    return "dspark_config" in raw or "dflash_config" in raw or "DSpark" in archs or "DFlash" in archs


# ---- the tensor form (same-host IPC or a distributed broadcast) --------------------------------------------
def _json_tensor(obj) -> Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).clone()


def _tensor_json(t: Tensor):
    return json.loads(bytes(t.to(torch.uint8).cpu().tolist()).decode())


def named_tensors(draft: DSparkDraft, version: str | None = None, step: int | None = None,
                  sps: SpsTable | None = None) -> list[tuple[str, Tensor]]:
    """A draft as the (name, tensor) list `/update_weights_from_tensor` carries: the `dspark_meta.*` entries first
    (config, STS, SPS, release), then every weight under the names the checkpoint uses."""
    out = [(META + "config", _json_tensor(draft.config.to_dict())),
           (META + "release", _json_tensor({"version": version, "step": step}))]
    if draft.config.sts_temperatures is not None:
        out.append((META + "sts", torch.tensor(draft.config.sts_temperatures, dtype=torch.float64)))
    if sps is not None:
        out.append((META + "sps", _json_tensor(sps.to_dict())))
    out += [(k, v.detach().contiguous().cpu()) for k, v in draft.state_dict().items()]
    return out


@dataclass
class Staging:
    """The parts of one tensor/distributed update received so far."""

    state: dict[str, Tensor] = field(default_factory=dict)
    meta: dict[str, object] = field(default_factory=dict)

    def add(self, items, expected: dict[str, torch.Size]) -> None:
        for name, t in items:
            if hasattr(t, "get") and not isinstance(t, Tensor):  # SGLang's LocalSerializedTensor (one entry per rank)
                from sglang.srt.runtime_context import get_parallel

                t = t.get(get_parallel().tp_rank)
            if name.startswith(META):
                key = name[len(META):]
                self.meta[key] = t.tolist() if key == "sts" else _tensor_json(t)
                continue
            canon = canonical_name(name)
            if canon is None:
                continue
            if canon not in expected:
                raise UpdateRefused(f"draft update has an unexpected tensor {name!r}")
            self.state[canon] = t.detach().clone()

    def complete(self, expected: dict[str, torch.Size]) -> bool:
        return set(self.state) >= set(expected)

    def release(self, serving: DSparkDraft, source: str) -> Release:
        try:
            config = (DSparkConfig.from_dict(self.meta["config"]) if "config" in self.meta
                      else DSparkConfig.from_dict(serving.config.to_dict()))
        except ConfigError as e:
            raise UpdateRefused(f"draft update config: {e}") from None
        sps = SpsTable.from_dict(self.meta["sps"]) if "sps" in self.meta else None
        rel = self.meta.get("release") or {}
        return build_release(serving, config, self.state, self.meta.get("sts"), sps, rel.get("version"),
                             rel.get("step"), source)


# ---- what SGLang's SchedulerWeightUpdaterManager drives ----------------------------------------------------
@dataclass
class UpdateRecord:
    """The `draft_update` entry of `/server_info` -> internal_states[0].dspark_info_record."""

    version: str | None = None
    step: int | None = None
    source: str = "start-up"
    swaps: int = 0
    refused: int = 0
    last_swap_ms: float | None = None
    last_error: str | None = None
    stale_rows: int = 0  # request-steps verified plain because their context predates the swap

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class DraftUpdater:
    """`runner.weight_updater` for the ("draft", runner) pair. Every call returns (success, message) and never
    raises: an exception here would end the scheduler.

    Under TP every rank's updater gets the same call at the same point of the scheduler loop and reads the update
    itself; `ranks` (RankSync) makes the outcome one for all: a staged part or a whole update is taken only if every
    rank took it (`RankSync.agree`), and which way a disk update goes (draft or target folder) is rank 0's view."""

    def __init__(self, get_draft, install, invalidate, ranks: RankSync | None = None):
        self._get_draft, self._install, self._invalidate = get_draft, install, invalidate
        self._ranks = ranks or RankSync()
        self.record = UpdateRecord()
        self._staging: Staging | None = None

    def _expected(self) -> dict[str, torch.Size]:
        return {k: v.shape for k, v in self._get_draft().state_dict().items()}

    def _refuse(self, error: str) -> tuple[bool, str]:
        self.record.refused += 1
        self.record.last_error = error
        logger.error("dspark-sgl draft update refused, the current draft keeps serving: %s", error)
        return False, f"draft update refused (the current draft keeps serving): {error}"

    def _swap(self, make) -> tuple[bool, str]:
        t0 = time.perf_counter()
        release, error = None, ""
        try:
            release = make()
        except (UpdateRefused, ValueError, KeyError, TypeError, RuntimeError, OSError) as e:
            error = str(e)
        ok, error = self._ranks.agree(release is not None, error)  # all ranks install it, or none
        if not ok:
            return self._refuse(error)
        self._install(release)
        ms = (time.perf_counter() - t0) * 1e3
        r = self.record
        r.version, r.step, r.source, r.last_swap_ms = release.version, release.step, release.source, ms
        r.swaps, r.last_error = r.swaps + 1, None
        logger.info("dspark-sgl draft updated to version %s (step %s) from %s in %.1f ms", r.version, r.step,
                    r.source, ms)
        return True, f"draft updated to version {r.version} (step {r.step}) in {ms:.1f} ms"

    # disk
    def update_weights_from_disk(self, model_path: str, load_format=None, recapture_cuda_graph: bool = False,
                                 **_unused) -> tuple[bool, str]:
        if not self._ranks.share_object(is_draft_folder(model_path)):  # `all` with a target folder: the target
            self._invalidate()                                          # changed, our context too
            return True, f"draft unchanged ({TARGET_CHANGED}; its old context is no longer read)"
        return self.update_draft_from_disk(model_path)

    def update_draft_from_disk(self, model_path: str) -> tuple[bool, str]:
        """A folder every rank has been told holds a draft (route_disk_update decided on rank 0's view)."""
        return self._swap(lambda: read_folder(self._get_draft(), model_path))

    # sessions: tensor and distributed
    def begin_weight_update(self) -> None:
        self._staging = Staging()

    def end_weight_update(self, run_post_load: bool = False) -> None:
        if self._staging is not None and (self._staging.state or self._staging.meta):
            missing = sorted(set(self._expected()) - set(self._staging.state))
            logger.error("dspark-sgl draft update session ended incomplete (missing %s); dropped", missing[:6])
            self.record.refused += 1
            self.record.last_error = f"session ended without tensors {missing[:6]}"
        self._staging = None

    def _stage(self, items, source: str) -> tuple[bool, str]:
        if self._staging is None:
            self._staging = Staging()
        expected, error = self._expected(), None
        try:
            self._staging.add(items, expected)
        except (UpdateRefused, ValueError) as e:
            error = str(e)
        ok, error = self._ranks.agree(error is None, error or "")  # every rank staged this part, or none keeps it
        if not ok:
            self._staging = Staging()
            return self._refuse(error)
        if not self._staging.complete(expected):
            n = len(self._staging.state)
            return True, f"draft update staged {n}/{len(expected)} tensors; it is installed when all have arrived"
        staging, self._staging = self._staging, Staging()
        return self._swap(lambda: staging.release(self._get_draft(), source))

    def update_weights_from_tensor(self, named_tensors, load_format=None, **_unused) -> tuple[bool, str]:
        if load_format not in (None, "direct"):
            return False, f"draft update: load_format {load_format!r} is not supported for the DSpark draft"
        return self._stage(named_tensors, "tensor")

    def load_weights_from_distributed(self, named_tensors) -> tuple[bool, str]:
        return self._stage(named_tensors, "distributed")

    def update_weights_from_ipc(self, recv_req) -> tuple[bool, str]:  # checkpoint-engine: target weights only
        self._invalidate()
        return True, f"draft unchanged ({TARGET_CHANGED}; its old context is no longer read)"


class DraftRunner:
    """The object SGLang expects in `weight_update_runners()`: `.weight_updater` plus `check_weights`."""

    def __init__(self, updater: DraftUpdater):
        self.weight_updater = updater

    def check_weights(self, action=None, allow_quant_error=False, skip_tensor_list=None, role="draft"):
        return None  # no checksum payload for the draft


# ---- plugin hooks (sglang imported lazily) -----------------------------------------------------------------
def route_disk_update(original, manager, recv_req):
    """AROUND SchedulerWeightUpdaterManager.update_weights_from_disk: a DSpark draft folder goes to the draft only.

    With a draft root set, every disk update (draft or target) must come from inside it; a refusal is SGLang's 400
    and nothing is loaded."""
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqOutput

    from dspark_sgl.sglang.ranks import tp_rank_sync

    refusal, root = None, draft_root()
    if root is not None:
        try:
            recv_req.model_path = str(inside_draft_root(recv_req.model_path, root))
        except UpdateRefused as e:
            refusal = str(e)
    # Every TP rank runs this for the same request; each decides from its own disk, and ranks that took different
    # branches would meet different collectives (a hang). Rank 0's decision is everyone's.
    refusal, recv_req.model_path, draft = tp_rank_sync().share_object(
        (refusal, recv_req.model_path, refusal is None and is_draft_folder(recv_req.model_path)))
    if refusal is not None:
        logger.error("dspark-sgl disk update refused, the current weights keep serving: %s", refusal)
        msg = f"disk update refused (the current weights keep serving): {refusal}"
        return UpdateWeightFromDiskReqOutput(success=False, num_paused_requests=0, message=msg)
    if not draft:
        return original(manager, recv_req)
    runners = manager._select_runners("draft")
    if not runners:
        msg = f"{recv_req.model_path} holds a DSpark draft but this server runs no draft; nothing was loaded"
        return UpdateWeightFromDiskReqOutput(success=False, message=msg, num_paused_requests=0)
    with manager._observe_weight_load("disk"):
        ok, msg = True, ""
        for _, runner in runners:
            ok, msg = runner.weight_updater.update_draft_from_disk(recv_req.model_path)
            if not ok:
                break
    if ok:
        manager.record_weight_version_after_update(recv_req.weight_version)
        n = evict_unused_prefixes(manager.scheduler)
        msg += f"; {n} cached prefix tokens with old-draft context evicted"
    return UpdateWeightFromDiskReqOutput(success=ok, message=msg, num_paused_requests=0)


def evict_unused_prefixes(scheduler) -> int:
    """Evict every radix-cached prefix no running request holds: its draft context came from the old draft, and a
    request reusing it would verify plain for its whole life. Prefixes of running requests stay (they are in use)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = getattr(scheduler, "tree_cache", None)
    n = int(cache.evictable_size()) if cache is not None and hasattr(cache, "evictable_size") else 0
    if n:
        cache.evict(EvictParams(num_tokens=n))
    return n


def keep_served_model_path(original, tokenizer_manager, model_path, load_format):
    """AROUND TokenizerManager._update_model_path_info: a draft update does not rename the served (target) model."""
    if is_draft_folder(model_path):
        return None
    return original(tokenizer_manager, model_path, load_format)


def pause_lease(tokenizer_manager) -> float:
    """Seconds a pause lasts without a `/continue_generation` (0: for ever), from the server's override args."""
    raw = json.loads(tokenizer_manager.server_args.json_model_override_args or "{}")
    return float(raw.get(PAUSE_LEASE_KEY, PAUSE_LEASE_S))


async def lease_pause(original, tokenizer_manager, obj, *args, **kwargs):
    """AROUND TokenizerManager.pause_generation: the pause ends by itself after its lease, so a pauser that died
    (a trainer killed mid-publish) cannot leave the server paused for good."""
    out = await original(tokenizer_manager, obj, *args, **kwargs)
    lease = pause_lease(tokenizer_manager)
    if lease > 0:
        n = tokenizer_manager._dspark_pauses = getattr(tokenizer_manager, "_dspark_pauses", 0) + 1
        # the loop keeps only a weak reference to a task: hold this one until it is done
        tokenizer_manager._dspark_lease = asyncio.create_task(_end_pause(tokenizer_manager, n, lease))
    return out


async def _end_pause(tokenizer_manager, n: int, lease: float) -> None:
    await asyncio.sleep(lease)
    if tokenizer_manager.is_pause and tokenizer_manager._dspark_pauses == n:  # still the pause this lease is for
        logger.warning("dspark-sgl: generation was paused for %g s with no /continue_generation (did the pauser "
                       "die?); continuing (%s)", lease, PAUSE_LEASE_KEY)
        await tokenizer_manager.continue_generation(_continue_request())


def _continue_request():
    from sglang.srt.managers.io_struct import ContinueGenerationReqInput

    return ContinueGenerationReqInput()
