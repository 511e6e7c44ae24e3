"""tools/count_prefill_ops.py: per method and cache state, the launches of one prefill on a
bench layer pattern at tiny widths; context signatures leave a tenth of the idle work
alone ones leave (their keeping, no pass);
warm PIC calls no fla chunk kernel (every linear layer one seam-chain call)."""
import json

from tools.count_prefill_ops import main


def test_counts_per_method_and_state(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert main(["--presets", "ring-bench", "--docs", "3", "--doc-tokens", "40", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["presets"]
    c = r["counts"]
    assert set(c) == {"full/cold", "prefix/warm", "prefix/half", "prefix/cold", "pic-alone/warm", "pic-alone/half",
                      "pic-alone/cold", "pic-context/warm", "pic-context/half", "pic-context/cold"}
    linear = r["layers"] - r["layers"] // 8  # ring: 7 scalar-decay layers of every 8
    assert c["pic-alone/warm"]["fla_calls"] == 0 and c["pic-alone/warm"]["chain_calls"] == linear
    assert c["full/cold"]["fla_calls"] == linear and c["full/cold"]["idle_launches"] == 0
    # alone signatures leave an alone pass; context ones only their keeping (a cat per signature)
    assert c["pic-alone/cold"]["idle_launches"] > 10 * c["pic-context/cold"]["idle_launches"] > 0
    for s in c.values():
        assert s["launches"] == s["compute_ops"] + s["fla_calls"] + s["chain_calls"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| ring-bench | pic-context/cold |")
