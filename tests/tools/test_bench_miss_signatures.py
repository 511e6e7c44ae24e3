"""tools/bench_miss_signatures.py on the CPU (ratios only): one cold rag stream per method
on one engine; with context signatures no alone pass runs and the hit rate is the alone
path's; the JSON holds every request and the ratios; the table prints last; bad options
are refused naming the flag."""
import json

import pytest

from tools.bench_miss_signatures import main, parse_args


def test_a_cpu_stream_runs_every_method_and_context_signatures_leave_no_idle_work(tmp_path, capsys):
    out = tmp_path / "ms.json"
    assert main(["--presets", "ring-tiny", "--n", "6", "--device", "cpu", "--baselines", "prefix",
                 "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    (preset,) = run["presets"]
    m = preset["methods"]
    assert set(m) == {"prefix", "pic-alone", "pic-context"}
    alone, ctx = m["pic-alone"]["summary"], m["pic-context"]["summary"]
    assert alone["requests"] == ctx["requests"] == 6 and len(m["pic-context"]["requests"]) == 6
    assert ctx["idle_segments"] == 0 and ctx["captured_segments"] > 0 and alone["idle_segments"] > 0
    assert alone["captured_segments"] == 0 and alone["hit_rate"] == ctx["hit_rate"]  # same hits, other source
    assert preset["ratios"]["work_alone_over_context"] == pytest.approx(alone["work_ms_mean"] / ctx["work_ms_mean"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("| ring-tiny |") and "x |" in lines[-1]


@pytest.mark.parametrize("argv, flag", [(["--n", "1"], "--n"), (["--baselines", "naive"], "--baselines"),
                                        (["--seam", "-1"], "--seam")])
def test_bad_options_are_refused(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and flag in capsys.readouterr().err
