"""`dspark serve`: real SGLang (`python -m sglang.launch_server`, OpenAI-compatible) with this project's plugin.

On a CPU the server gets the fp32-lossless CPU arguments (torch_native attention, no CUDA graphs, a small KV pool) and
the pure-torch stand-ins of dspark_sgl.sglang.cpu for what its interpreter lacks; on CUDA it gets neither. Arguments
the user adds after ours reach SGLang last, so they win. Nothing here imports sglang: the server runs in `python`,
probed first so that a missing install is one clear error naming the extra.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from dspark_sgl.dtypes import DTYPE_NAMES, dtype_name, resolve_dtype
from dspark_sgl.sglang.cpu import PLUGIN_ENTRY_POINTS, cpu_server_flags, probe, server_env, tp_size_of
from dspark_sgl.speculative.scheduler import MODES

SGLANG_VERSION = "0.5.23"
DEVICES = ("cpu", "cuda")
INSTALL_HINT = (f"pip install 'dspark-sgl[serve-cpu]' && pip install --no-deps sglang=={SGLANG_VERSION} "
                "(or: bash .ci/install_sglang.sh VENV)")
CPU_SERVER_ARGS = tuple(cpu_server_flags())  # the fp32-lossless CPU server (dspark_sgl.sglang.cpu)


class ServeError(ValueError):
    """A bad serve setting or a missing install: one line for the user."""


@dataclass
class ServeConfig:
    target: Path
    draft: Path | None = None  # None: plain decoding (or a speculative algorithm named in `extra`)
    dtype: str = "auto"  # auto: bf16 only where the hardware multiplies bf16 natively (dspark_sgl.dtypes), else fp32
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 30000
    python: Path = field(default_factory=lambda: Path(sys.executable))
    extra: list[str] = field(default_factory=list)  # passed to SGLang verbatim, last
    draft_dtype: str | None = None  # None: the target's; a bf16 draft beside an fp32 target stays lossless
    draft_root: Path | None = None  # None: disk updates may load any folder; else only folders inside this one
    match: bool | None = None  # the hybrid: each step verifies the draft's block or a match from the request's own
    # text; None: on wherever a draft is served (it measured >= the draft alone and >= NGRAM on all three sets at
    # batch 1 and 4: docs/serving.md), False: the draft alone (`--no-match`)
    speculate: str | None = None  # auto (the full-cost rule) | on | off | match; None: auto (static schedule: on)
    speculate_max_batch: int | None = None  # larger batches never speculate

    def validate(self) -> None:
        if self.device not in DEVICES:
            raise ServeError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ServeError(f"--dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        if self.draft_dtype is not None and self.draft_dtype not in DTYPE_NAMES:
            raise ServeError(f"--draft-dtype must be one of {DTYPE_NAMES}, got {self.draft_dtype!r}")
        if self.draft_dtype is not None and self.draft is None:
            raise ServeError("--draft-dtype needs --draft")
        if self.match is not None and self.draft is None:
            raise ServeError("--match / --no-match need --draft (the hybrid chooses between the draft's block and a "
                             "match)")
        if self.speculate is not None and self.speculate not in MODES:
            raise ServeError(f"--speculate must be one of {', '.join(MODES)}, got {self.speculate!r}")
        if self.speculate_max_batch is not None and self.speculate_max_batch < 0:
            raise ServeError(f"--speculate-max-batch must be >= 0, got {self.speculate_max_batch}")
        if (self.speculate is not None or self.speculate_max_batch is not None) and self.draft is None:
            raise ServeError("--speculate / --speculate-max-batch need --draft")
        if self.draft_root is not None and not self.draft_root.is_dir():
            raise ServeError(f"--draft-root {str(self.draft_root)!r} is not a folder")
        if not 0 < self.port < 65536:
            raise ServeError(f"--port must be in 1..65535, got {self.port}")
        if not self.python.is_file():
            raise ServeError(f"--python {str(self.python)!r} is not an interpreter")
        if not (self.target / "config.json").is_file():
            raise ServeError(f"target {str(self.target)!r} is not a model folder with config.json")
        if self.draft is not None:
            if not (self.draft / "config.json").is_file():
                raise ServeError(f"draft {str(self.draft)!r} is not a draft folder with config.json")
            if "--speculative-algorithm" in self.extra:
                raise ServeError("--draft serves DSPARK; pass --no-draft to choose another --speculative-algorithm")


def server_args(cfg: ServeConfig) -> list[str]:
    """The arguments after `python -m sglang.launch_server`."""
    args = ["--model-path", str(cfg.target), "--host", cfg.host, "--port", str(cfg.port), "--dtype", cfg.dtype]
    if cfg.device == "cpu":
        args += CPU_SERVER_ARGS
    if cfg.draft is not None:
        args += ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(cfg.draft.resolve())]
    ours = {}  # what the worker and plugin read from the override args, merged with the user's own
    if cfg.draft_dtype is not None:
        ours["dspark_draft_dtype"] = cfg.draft_dtype
    if cfg.draft_root is not None:
        ours["dspark_draft_root"] = str(cfg.draft_root.resolve())
    if cfg.draft is not None:
        ours["dspark_match"] = cfg.match is not False
    if cfg.speculate is not None:
        ours["dspark_speculate"] = cfg.speculate
    if cfg.speculate_max_batch is not None:
        ours["dspark_speculate_max_batch"] = cfg.speculate_max_batch
    extra = list(cfg.extra)
    if ours:
        flag = "--json-model-override-args"
        at = extra.index(flag) + 1 if flag in extra else None
        try:
            override = json.loads(extra[at]) if at is not None else {}
        except (json.JSONDecodeError, IndexError) as e:
            raise ServeError(f"{flag} must be one JSON object: {e}") from None
        override.update(ours)
        if at is None:
            args += [flag, json.dumps(override)]
        else:
            extra[at] = json.dumps(override)
    return args + extra


def exposure_warning(cfg: ServeConfig) -> str | None:
    """A warning when the server listens beyond this machine without SGLang's --admin-api-key, else None."""
    if any(a == "--admin-api-key" or a.startswith("--admin-api-key=") for a in cfg.extra):
        return None
    try:
        loopback = cfg.host == "localhost" or ipaddress.ip_address(cfg.host).is_loopback
    except ValueError:  # a host name: only "localhost" is known to stay on this machine
        loopback = False
    if loopback:
        return None
    return (f"warning: serving on {cfg.host}:{cfg.port} without --admin-api-key: anyone who can reach it can replace "
            "the draft or the target's weights (/update_weights_from_disk, /update_weights_from_tensor, "
            "/update_weights_from_distributed), pause generation, abort every request and flush the cache. "
            "Add --admin-api-key KEY (the trainer sends it: publish.admin_key_env).")


def prepare(cfg: ServeConfig) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of the server; raises ServeError for a bad setting or an incomplete install."""
    cfg.validate()
    facts = probe(cfg.python)
    if facts["sglang"] is None:
        raise ServeError(f"sglang is not installed for {cfg.python}: {INSTALL_HINT}")
    if facts["sglang"] != SGLANG_VERSION:
        raise ServeError(f"dspark serve needs sglang {SGLANG_VERSION}, {cfg.python} has {facts['sglang']}")
    absent = [name for name in PLUGIN_ENTRY_POINTS if name not in facts["plugins"]]
    if absent:
        raise ServeError(f"the sglang.srt.plugins entry points {absent} are not installed for {cfg.python}: "
                         "reinstall dspark-sgl (pip install -e . or pip install dspark-sgl)")
    try:
        tp = tp_size_of(cfg.extra)
        env = server_env(cfg.python, facts=facts, tp_size=tp) if cfg.device == "cpu" else dict(os.environ)
    except (ValueError, IndexError) as e:
        raise ServeError(f"--tp-size: {e}") from None
    cfg = replace(cfg, dtype=dtype_name(resolve_dtype(cfg.dtype, cfg.device, what="--dtype")))
    return [str(cfg.python), "-m", "sglang.launch_server", *server_args(cfg)], env


def exec_server(cmd: list[str], env: dict[str, str]) -> None:
    """Become the server (signals such as Ctrl-C then reach SGLang directly)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)
