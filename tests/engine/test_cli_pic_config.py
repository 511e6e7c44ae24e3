"""`--pic-config FILE` and the one settings object (engine.connector.settings.PicSettings):
the example file is the defaults; unknown tables and keys, values of the wrong type and
values PicConfig / StoreConnectorConfig refuse are one-line errors naming the key (exit 2
through `kvengine`); `--method` / `--seam` win over the file; `serve` refuses PIC options
without `--store` instead of ignoring them; run, serve and the tools share the defaults."""
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.cli import app
from engine.connector.config import StoreConnectorConfig
from engine.connector.settings import PIC_KEYS, STORE_KEYS, PicSettings, PicSettingsError, load_settings
from engine.pic.config import PicConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["## doc 1\nk1aa: v1aa\nk1bb: v1bb\n", "## doc 2\nk2aa: v2aa\nk2bb: v2bb\n"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pic.toml"
    path.write_text(text)
    return str(path)


def test_the_example_file_holds_the_defaults_and_documents_every_key():
    example = ROOT / "docs" / "examples" / "pic.toml"
    assert load_settings(example) == PicSettings()
    text = example.read_text()
    doc = (ROOT / "docs" / "pic.md").read_text()
    for key in list(PIC_KEYS) + list(STORE_KEYS):
        assert key in text and f"`{key}`" in doc, key
    # one set of defaults: the measured best (docs/pic.md, "Settings")
    assert PicSettings().pic == PicConfig() and PicSettings().store == StoreConnectorConfig()
    assert (PicConfig().miss_path, PicConfig().cold_full_fraction, PicConfig().miss_signatures) == \
        ("context", None, "alone")


def test_a_good_file_changes_only_its_keys(tmp_path):
    s = load_settings(toml(tmp_path, '[pic]\nseam = 4\nmiss_path = "alone"\ncold_full_fraction = 0.5\n'
                                     '[store]\nshare_cold = false\nput_tier = "cpu"\nrpc_timeout_s = 2\n'))
    assert (s.pic.seam, s.pic.miss_path, s.pic.cold_full_fraction) == (4, "alone", 0.5)
    assert (s.store.share_cold, s.store.put_tier, s.store.rpc_timeout_s) == (False, "cpu", 2)
    assert s.pic.exact_prefix and s.store.dedup  # the rest stays at the defaults
    assert s.connector(None) is None and s.connector("").socket is None and s.connector("/x.sock").socket == "/x.sock"
    assert s.connector("/x.sock").share_cold is False


@pytest.mark.parametrize("text, message", [
    ("[pic]\nsem = 4\n", "unknown key pic.sem"),
    ("[pic]\nidle_resume = false\n", "unknown key pic.idle_resume"),  # an experiment switch, not a setting
    ("[store]\nsocket = \"/x.sock\"\n", "unknown key store.socket"),  # where the daemon is: --store
    ("[engine]\nseam = 4\n", "unknown table [engine]"),
    ("pic = 4\n", "pic must be a table"),
    ("[pic]\nseam = \"16\"\n", "pic.seam = '16' must be an integer"),
    ("[pic]\nseam = -1\n", "pic.seam = -1 must be an int >= 0"),
    ("[pic]\nfused = 1\n", "pic.fused = 1 must be true/false"),
    ("[pic]\nmiss_path = \"later\"\n", "pic.miss_path = 'later' must be one of alone, context"),
    ("[pic]\ncold_full_fraction = 1.5\n", "pic.cold_full_fraction = 1.5 must be None or a number in (0, 1]"),
    ("[pic]\nfused = false\n", "miss_path"),  # the step plan computes misses alone: say which key to set
    ("[store]\nshare_keep = 2.0\n", "store.share_keep = 2.0 must be a number in (0, 1]"),
    ("[store]\nput_tier = \"tape\"\n", "store.put_tier = 'tape' must be one of gpu, cpu, nvme"),
    ("[pic\nseam = 4\n", "not valid TOML"),
])
def test_bad_files_are_one_line_errors_naming_the_key(tmp_path, text, message):
    path = toml(tmp_path, text)
    with pytest.raises(PicSettingsError) as err:
        load_settings(path)
    assert message in str(err.value) and str(err.value).startswith(path) and "\n" not in str(err.value)


def test_kvengine_names_the_file_and_key_and_exits_2(tmp_path):
    path = toml(tmp_path, "[pic]\nmiss_path = \"later\"\n")
    res = CliRunner().invoke(app, ["run", "--preset", "qwen3next-tiny", "--requests", "x.jsonl", "--pic-config", path])
    assert res.exit_code == 2
    assert res.stderr.strip() == f"kvengine: error: --pic-config: {path}: pic.miss_path = 'later' must be one of " \
                                 "alone, context"
    res = CliRunner().invoke(app, ["run", "--preset", "qwen3next-tiny", "--requests", "x.jsonl", "--pic-config",
                                   str(tmp_path / "none.toml")])
    assert res.exit_code == 2 and "none.toml: cannot read" in res.stderr


def test_flags_win_over_the_file_and_the_file_over_the_defaults(tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"id": rid, "segments": [{"text": DOCS[i], "cache": True} for i in order]
                                            + [{"text": "Q: k1bb?\nA: ", "cache": False}]}) + "\n"
                                for rid, order in (("a", (0, 1)), ("b", (1, 0)))))
    path = toml(tmp_path, '[pic]\nmethod = "naive"\nseam = 2\nmiss_path = "alone"\n')

    def run(*extra):
        res = CliRunner().invoke(app, ["run", "--preset", "qwen3next-tiny", "--requests", str(requests),
                                       "--max-new-tokens", "1", "--device", "cpu", "--pic-config", path, *extra])
        assert res.exit_code == 0, res.output
        return res.stdout

    from_file = run()  # method and seam from the file: naive (no seams), title "method=naive"
    assert "method=naive" in from_file
    flags = run("--method", "pic", "--seam", "3", "--json")
    b = [json.loads(line) for line in flags.splitlines() if line.startswith("{")][1]
    # --method pic, --seam 3 over the file's naive/2; miss_path "alone" from the file: b's
    # documents were computed alone by a and are spliced, each later one behind a seam of 3
    assert b["method"] == "pic" and b["hit_segments"] == 2 and b["miss_tokens"] == 0
    assert b["seam_tokens"] == 3


def test_serve_refuses_pic_options_without_store(tmp_path):
    path = toml(tmp_path, "[pic]\nseam = 4\n")
    for extra, named in ((["--pic-config", path], "--pic-config"), (["--seam", "4"], "--seam")):
        res = CliRunner().invoke(app, ["serve", "--preset", "qwen3next-tiny", "--port", "0", *extra])
        assert res.exit_code == 2, res.output
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"kvengine: error: {named}: ") and "--store" in err[0]


def test_serve_checks_the_file_before_it_builds_the_engine(tmp_path):
    path = toml(tmp_path, "[store]\nshare_wait_s = 0\n")
    res = CliRunner().invoke(app, ["serve", "--preset", "qwen3next-tiny", "--port", "0", "--store", "/nonexistent.sock",
                                   "--pic-config", path])
    assert res.exit_code == 2
    assert "store.share_wait_s = 0 must be a finite number > 0" in res.stderr


def test_run_and_serve_share_one_option_list():
    run_help = CliRunner().invoke(app, ["run", "--help"]).stdout
    serve_help = CliRunner().invoke(app, ["serve", "--help"]).stdout
    for flag in ("--store", "--start-without-store", "--seam", "--pic-config", "--preset", "--model", "--hisparse"):
        assert flag in run_help and flag in serve_help, flag
    assert f"(default {PicConfig().seam}" in " ".join(run_help.split())  # the help states the one default
    for gone in ("--miss-path", "--cold-full-fraction", "--share-cold", "--no-fused", "--cache-gib",
                 "--prefix-checkpoints", "--exact-prefix", "--state-dtype", "--swa-seam"):
        assert gone not in run_help and gone not in serve_help, gone


def test_serve_with_store_runs_the_files_settings_under_the_flags(tmp_path, monkeypatch):
    """serve --store --pic-config: the planner it attaches gets the file's [pic] and [store]
    settings, --seam over the file's seam (no daemon needed: --start-without-store; the
    HTTP server itself is replaced by a stub that returns at once)."""
    import engine.cli_serve as cli_serve
    import engine.server.app as server_app

    attached = []

    def attach(engine, pic, connector):
        planner = cli_serve_attach(engine, pic, connector)
        attached.append((pic, connector, planner))
        return planner

    cli_serve_attach = cli_serve.attach_store
    monkeypatch.setattr(cli_serve, "attach_store", attach)
    monkeypatch.setattr(server_app, "serve", lambda engine, host, port, name: None)
    path = toml(tmp_path, '[pic]\nseam = 4\nexact_prefix = false\n[store]\nshare_cold = false\nrpc_timeout_s = 0.2\n')
    res = CliRunner().invoke(app, ["serve", "--preset", "qwen3next-tiny", "--device", "cpu", "--port", "0",
                                   "--store", str(tmp_path / "no-daemon.sock"), "--start-without-store",
                                   "--pic-config", path, "--seam", "6"])
    assert res.exit_code == 0, res.output
    (pic, connector, planner), = attached
    assert (pic.seam, pic.exact_prefix, pic.miss_path, pic.cold_full_fraction) == (6, False, "context", None)
    assert connector.socket == str(tmp_path / "no-daemon.sock") and not connector.share_cold
    assert planner.config == pic and planner.store.share is None  # cold sharing off, as the file says


def test_serve_with_store_and_hisparse_attaches_pic_over_the_hisparse_caches(tmp_path, monkeypatch):
    """serve --store --hisparse: PIC's planner is attached to an engine whose full-attention
    layers are HiSparse layer caches, exact prefixes turned off (their checkpoints restore
    into the paged cache), with a note saying so."""
    import engine.server.app as server_app

    engines = []
    monkeypatch.setattr(server_app, "serve", lambda engine, host, port, name: engines.append(engine))
    res = CliRunner().invoke(app, ["serve", "--preset", "qwen3next-tiny", "--device", "cpu", "--port", "0",
                                   "--store", str(tmp_path / "no-daemon.sock"), "--start-without-store",
                                   "--hisparse"])
    assert res.exit_code == 0, res.output
    assert "exact-prefix reuse is off" in res.output
    engine, = engines
    assert engine.kv_offload is not None and engine.kv_offload.layers
    assert engine.planner.supports_external_kv and not engine.planner.config.exact_prefix
