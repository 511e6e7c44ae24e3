"""tools/bench_alone_pass.py on the CPU (ratios only): both paths timed side by side per
batch shape, the JSON holds every run and the break-even share, the table prints last;
bad shapes are refused naming the flag."""
import json

import pytest

from tools.bench_alone_pass import main, parse_args


def test_a_cpu_run_times_both_paths_and_writes_the_break_even(tmp_path, capsys):
    out = tmp_path / "alone.json"
    assert main(["--presets", "ring-tiny", "--device", "cpu", "--shapes", "2x24", "--repeats", "2",
                 "--tail-states", "both", "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    (row,) = run["rows"]
    assert (row["segments"], row["tokens_per_segment"]) == (2, 24)
    assert len(row["alone_runs_ms"]) == len(row["full_runs_ms"]) == 2 and row["alone_ms"] > 0 and row["full_ms"] > 0
    assert row["break_even"] == pytest.approx(row["full_ms_per_token"] / row["alone_ms_per_token"])
    assert row["tail_states"] == "fla" and len(row["alone_direct_tails_runs_ms"]) == 2
    assert row["alone_direct_tails_ms"] > 0
    assert run["command"].startswith("python tools/bench_alone_pass.py")
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| ring-tiny | 2x24 |")


@pytest.mark.parametrize("shapes", ["2by24", "0x24", ""])
def test_bad_shapes_are_refused(shapes, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--shapes", shapes])
    assert exc.value.code == 2 and "--shapes" in capsys.readouterr().err


def test_sync_sites_counts_the_sync_warnings_by_call_site_and_ignores_other_warnings(monkeypatch):
    """The --sync-sites recorder on the CPU: torch.cuda's debug-mode switch is replaced by
    a no-op and the function under test emits the warning CUDA's sync debug mode emits."""
    import warnings

    import torch

    from tools.bench_alone_pass import sync_sites

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def fn():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")  # line A
        warnings.warn("called a synchronizing CUDA operation")  # line B
        warnings.warn("something else entirely")

    got = sync_sites(fn, lambda: None)
    assert modes == ["warn", "default"]
    assert sorted(got.values()) == [1, 3] and len(got) == 2
    assert all(site.startswith("test_bench_alone_pass.py:") for site in got)
