"""`dspark serve`: the SGLang command it builds and every bad setting as one clear error (no server started here;
tests/test_sglang_serve.py starts real ones)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_sgl.cli import app
from dspark_sgl.sglang import serve
from dspark_sgl.sglang.cpu import STANDINS

runner = CliRunner()
INSTALLED = {"sglang": serve.SGLANG_VERSION, "missing": ["sgl_kernel"], "plugins": ["dspark", "dspark_cpu"]}


@pytest.fixture
def folders(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    for d in (target, draft):
        d.mkdir()
        (d / "config.json").write_text("{}")
    return target, draft


def _flag(args: list[str], name: str) -> str:
    return args[len(args) - 1 - args[::-1].index(name) + 1]  # the last occurrence wins in argparse


def test_cpu_command_serves_dspark_with_the_cpu_args_and_user_args_last(folders, monkeypatch):
    target, draft = folders
    monkeypatch.setattr(serve, "probe", lambda python, env=None: INSTALLED)
    cfg = serve.ServeConfig(target, draft, dtype="float32", port=31234, extra=["--max-total-tokens", "4096"])
    cmd, env = serve.prepare(cfg)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert _flag(cmd, "--speculative-algorithm") == "DSPARK"
    assert _flag(cmd, "--speculative-draft-model-path") == str(draft.resolve())
    assert _flag(cmd, "--device") == "cpu" and _flag(cmd, "--attention-backend") == "torch_native"
    assert _flag(cmd, "--dtype") == "float32" and _flag(cmd, "--port") == "31234"
    assert _flag(cmd, "--max-total-tokens") == "4096"  # the user's, after ours
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(STANDINS["sgl_kernel"])
    assert str(STANDINS["torchvision"]) not in env["PYTHONPATH"]  # only what the probe found missing


def test_auto_dtype_reaches_sglang_as_a_concrete_name(folders, monkeypatch):
    monkeypatch.setattr(serve, "probe", lambda python, env=None: INSTALLED)
    cmd, _ = serve.prepare(serve.ServeConfig(folders[0], None))
    assert _flag(cmd, "--dtype") in ("float32", "bfloat16")  # SGLang's own `auto` would mean the checkpoint's dtype


def test_cuda_command_gets_no_cpu_args_and_no_standins(folders, monkeypatch):
    target, _ = folders
    monkeypatch.setattr(serve, "probe", lambda python, env=None: INSTALLED)
    cmd, env = serve.prepare(serve.ServeConfig(target, None, device="cuda", dtype="bfloat16"))
    assert "--device" not in cmd and "--speculative-algorithm" not in cmd and _flag(cmd, "--dtype") == "bfloat16"
    assert all(str(p) not in env.get("PYTHONPATH", "") for p in STANDINS.values())


@pytest.mark.parametrize(("change", "message"), [
    ({"dtype": "fp8"}, "--dtype must be one of"),
    ({"device": "tpu"}, "--device must be one of"),
    ({"port": 70000}, "--port must be in 1..65535"),
    ({"python": Path("/nonexistent/python")}, "is not an interpreter"),
    ({"draft": Path("/nonexistent/draft")}, "is not a draft folder"),
    ({"target": Path("/nonexistent/target")}, "is not a model folder"),
    ({"extra": ["--speculative-algorithm", "NGRAM"]}, "pass --no-draft to choose another"),
])
def test_bad_settings_are_one_clear_error(folders, change, message):
    target, draft = folders
    cfg = serve.ServeConfig(target, draft)
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(serve.ServeError, match=message):
        serve.prepare(cfg)


@pytest.mark.parametrize(("facts", "message"), [
    ({"sglang": None, "missing": [], "plugins": []}, r"sglang is not installed .*dspark-sgl\[serve-cpu\]"),
    ({"sglang": "0.5.9", "missing": [], "plugins": []}, "needs sglang 0.5.23"),
    ({"sglang": "0.5.23", "missing": [], "plugins": ["dspark"]}, r"\['dspark_cpu'\] are not installed"),
])
def test_an_incomplete_install_is_named(folders, monkeypatch, facts, message):
    monkeypatch.setattr(serve, "probe", lambda python, env=None: facts)
    with pytest.raises(serve.ServeError, match=message):
        serve.prepare(serve.ServeConfig(*folders))


def test_cli_exits_2_with_one_line_naming_the_extra(folders, monkeypatch):
    target, draft = folders
    monkeypatch.setattr(serve, "probe", lambda python, env=None: {"sglang": None, "missing": [], "plugins": []})
    res = runner.invoke(app, ["serve", "--target", str(target), "--draft", str(draft)])
    assert res.exit_code == 2 and "dspark-sgl[serve-cpu]" in res.output.replace("\n", "")
    assert "Traceback" not in res.output
    both = runner.invoke(app, ["serve", "--target", str(target), "--draft", str(draft), "--no-draft"])
    neither = runner.invoke(app, ["serve", "--target", str(target)])
    for res in (both, neither):
        assert res.exit_code == 2 and "exactly one of --draft DIR or --no-draft" in res.output


def test_draft_dtype_travels_in_the_override_args_merged_with_the_users(folders, monkeypatch):
    import json

    target, draft = folders
    monkeypatch.setattr(serve, "probe", lambda python, env=None: INSTALLED)
    cmd, _ = serve.prepare(serve.ServeConfig(target, draft, dtype="float32", draft_dtype="bfloat16"))
    assert json.loads(_flag(cmd, "--json-model-override-args")) == {"dspark_draft_dtype": "bfloat16",
                                                                     "dspark_match": True}
    user = ["--json-model-override-args", json.dumps({"dspark_traffic": {"dir": "/tmp/t"}})]
    cmd, _ = serve.prepare(serve.ServeConfig(target, draft, draft_dtype="auto", extra=user))
    assert cmd.count("--json-model-override-args") == 1
    assert json.loads(_flag(cmd, "--json-model-override-args")) == {"dspark_traffic": {"dir": "/tmp/t"},
                                                                     "dspark_draft_dtype": "auto",
                                                                     "dspark_match": True}
    # default: the draft runs in the target's dtype, with the hybrid on (the worker's own default is off: the flag
    # is always written, so the command means the same whatever the plugin's default)
    cmd, _ = serve.prepare(serve.ServeConfig(target, draft))
    assert json.loads(_flag(cmd, "--json-model-override-args")) == {"dspark_match": True}
    cmd, _ = serve.prepare(serve.ServeConfig(target, draft, match=False, speculate="off", speculate_max_batch=8))
    assert json.loads(_flag(cmd, "--json-model-override-args")) == {"dspark_match": False, "dspark_speculate": "off",
                                                                     "dspark_speculate_max_batch": 8}
    cmd, _ = serve.prepare(serve.ServeConfig(target, None))
    assert "--json-model-override-args" not in cmd  # plain: none of ours


@pytest.mark.parametrize("kwargs, message", [
    (dict(draft_dtype="fp7"), "--draft-dtype must be one of"),
    (dict(draft_dtype="bfloat16", no_draft=True), "--draft-dtype needs --draft"),
    (dict(draft_dtype="bfloat16", extra=["--json-model-override-args", "{oops"]), "must be one JSON object"),
    (dict(speculate="sometimes"), "--speculate must be one of auto, on, off, match"),
    (dict(speculate_max_batch=-1), "--speculate-max-batch must be >= 0"),
    (dict(speculate="off", no_draft=True), "--speculate / --speculate-max-batch need --draft"),
    (dict(match=True, no_draft=True), "--match / --no-match need --draft"),
    (dict(match=False, no_draft=True), "--match / --no-match need --draft"),
])
def test_bad_draft_dtype_settings_are_one_clear_error(folders, monkeypatch, kwargs, message):
    target, draft = folders
    monkeypatch.setattr(serve, "probe", lambda python, env=None: INSTALLED)
    draft = None if kwargs.pop("no_draft", False) else draft
    with pytest.raises(serve.ServeError, match=message):
        serve.prepare(serve.ServeConfig(target, draft, **kwargs))


@pytest.mark.parametrize(
    ("host", "extra", "warned"),
    [
        ("0.0.0.0", [], True),
        ("10.1.2.3", [], True),
        ("::", [], True),
        ("my-host.example", [], True),  # a name may resolve anywhere
        ("0.0.0.0", ["--admin-api-key", "k"], False),
        ("0.0.0.0", ["--admin-api-key=k"], False),
        ("127.0.0.1", [], False),
        ("127.0.0.2", [], False),
        ("::1", [], False),
        ("localhost", [], False),
    ],
)
def test_a_server_beyond_loopback_without_the_admin_key_is_warned_about(folders, host, extra, warned):
    warning = serve.exposure_warning(serve.ServeConfig(folders[0], None, host=host, extra=extra))
    assert (warning is not None) == warned
    if warned:
        assert f"{host}:30000 without --admin-api-key" in warning and "replace the draft" in warning


def test_cli_prints_the_exposure_warning_before_starting(folders, monkeypatch):
    from dspark_sgl import cli

    target, _ = folders
    monkeypatch.setattr(serve, "probe", lambda python, env=None: INSTALLED)
    started = []
    monkeypatch.setattr(serve, "exec_server", lambda cmd, env: started.append(cmd))
    res = runner.invoke(cli.app, ["serve", "--target", str(target), "--no-draft", "--host", "0.0.0.0"])
    assert res.exit_code == 0 and started and "without --admin-api-key" in res.output
    res = runner.invoke(cli.app, ["serve", "--target", str(target), "--no-draft", "--host", "0.0.0.0",
                                  "--admin-api-key", "k"])
    assert res.exit_code == 0 and "without --admin-api-key" not in res.output


def test_draft_root_travels_resolved_in_the_override_args(folders, monkeypatch, tmp_path):
    import json

    target, draft = folders
    monkeypatch.setattr(serve, "probe", lambda python, env=None: INSTALLED)
    (tmp_path / "drafts").mkdir()
    monkeypatch.chdir(tmp_path)
    user = ["--json-model-override-args", json.dumps({"dspark_traffic": {"dir": "/tmp/t"}})]
    cmd, _ = serve.prepare(serve.ServeConfig(target, draft, draft_root=Path("drafts"), extra=user))
    assert json.loads(_flag(cmd, "--json-model-override-args")) == {"dspark_traffic": {"dir": "/tmp/t"},
                                                                     "dspark_draft_root": str(tmp_path / "drafts"),
                                                                     "dspark_match": True}
    with pytest.raises(serve.ServeError, match="--draft-root 'nowhere' is not a folder"):
        serve.prepare(serve.ServeConfig(target, draft, draft_root=Path("nowhere")))
    started = []
    monkeypatch.setattr(serve, "exec_server", lambda cmd, env: started.append(cmd))
    res = runner.invoke(app, ["serve", "--target", str(target), "--draft", str(draft), "--draft-root", "drafts"])
    assert res.exit_code == 0, res.output
    sent = json.loads(_flag(started[0], "--json-model-override-args"))
    assert sent == {"dspark_draft_root": str(tmp_path / "drafts"), "dspark_match": True}
    # the hybrid is the command's default; --no-match serves the draft alone, and names no hybrid without a draft
    res = runner.invoke(app, ["serve", "--target", str(target), "--draft", str(draft), "--no-match"])
    assert res.exit_code == 0, res.output
    assert json.loads(_flag(started[1], "--json-model-override-args")) == {"dspark_match": False}
    res = runner.invoke(app, ["serve", "--target", str(target), "--no-draft", "--match"])
    assert res.exit_code == 2 and "--match / --no-match need --draft" in res.output, res.output


def test_cpu_tp_gives_each_rank_its_cores_unless_named(folders, monkeypatch):
    """SGLang's CPU TP asserts a NUMA node per rank unless SGLANG_CPU_OMP_THREADS_BIND names each rank's cores."""
    from dspark_sgl.sglang.cpu import omp_bind, tp_size_of

    assert tp_size_of(["--tp-size", "2"]) == 2 and tp_size_of(["--tensor-parallel-size=4", "--tp", "2"]) == 2
    assert tp_size_of(["--dp-size", "2"]) == 1
    assert omp_bind(2, [0, 1]) == "0|1" and omp_bind(2, [7, 0, 1, 2, 3, 4, 5, 6]) == "0-3|4-7"
    assert omp_bind(2, [0, 2, 4, 6]) == "0,2|4,6"
    with pytest.raises(ValueError, match="needs a core per rank"):
        omp_bind(3, [0, 1])
    monkeypatch.setattr(serve, "probe", lambda python, env=None: INSTALLED)
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    cfg = serve.ServeConfig(folders[0], None, dtype="float32", extra=["--tp-size", "2"])
    assert serve.prepare(cfg)[1]["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in serve.prepare(serve.ServeConfig(folders[0], None))[1]
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "1|0")  # the operator's choice stays
    assert serve.prepare(cfg)[1]["SGLANG_CPU_OMP_THREADS_BIND"] == "1|0"


def test_profile_costs_takes_the_serve_commands_hybrid_flag(tmp_path, monkeypatch):
    """`dspark profile-costs` measures with the flags `dspark serve` will run: --no-match reaches its server as the
    serve command sends it (an unknown flag would go on to SGLang and stop it), and the default is the hybrid."""
    import json

    from dspark_sgl.model.checkpoint import save_draft
    from dspark_sgl.model.draft import DSparkDraft
    from dspark_sgl.sglang import profile
    from dspark_sgl.sglang.planning import SPS_CACHE_ENV
    from tests.conftest import tiny_draft_config

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 64}))
    draft = save_draft(DSparkDraft(tiny_draft_config()), tmp_path / "draft")
    monkeypatch.setattr(serve, "probe", lambda python, env=None: INSTALLED)
    monkeypatch.setenv(SPS_CACHE_ENV, str(tmp_path / "cache"))
    started = []

    class Started(Exception):
        pass

    def server(cmd, env, port, log):
        started.append(cmd)
        raise Started

    monkeypatch.setattr(profile, "ProfileServer", server)
    for flags in (["--no-match"], []):
        res = runner.invoke(app, ["profile-costs", "--target", str(target), "--draft", str(draft), *flags])
        assert isinstance(res.exception, Started), res.output
    assert [json.loads(_flag(c, "--json-model-override-args"))["dspark_match"] for c in started] == [False, True]
    assert all("--no-match" not in c for c in started)
