"""Tests of tools.workloads: determinism, segment reuse, well-formed questions (a
rule-based solver that reads only the prompt text answers every request), two-hop
structure, scoring, and the CLI's JSONL output."""
from __future__ import annotations

import collections
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.workloads import (ANSWER_END, TASKS, Request, UnknownTaskError, WorkloadConfigError,
                             exact_match, first_line, generate, iter_requests, make_config,
                             read_requests, rouge_l, write_requests,
                             sample_training_example, sample_training_request, score, token_f1,
                             workload_stats)
from tools.workloads.errors import GenerationError, RecordFormatError

ROOT = Path(__file__).resolve().parents[2]
FACT_LINE = re.compile(r"^([a-z0-9]+): ([a-z0-9]+)$")
EXAMPLE_LINE = re.compile(r"^([a-z]+) -> ([a-z]+)$")


# ---------------------------------------------------------------- reference solver
# It reads only the prompt text (never the generator's internals) and must answer
# every request: that proves each question is answerable from its prompt.

def _question(req: Request) -> str:
    text = req.segments[-1].text
    assert text.startswith("Q: ") and text.endswith("\nA: "), text
    return text[3:-4]


def _facts(req: Request) -> list[tuple[str, str, int]]:
    """(key, value, segment index) of every fact line in the cacheable segments."""
    out = []
    for s, seg in enumerate(req.segments[:-1]):
        for line in seg.text.splitlines():
            m = FACT_LINE.match(line)
            if m:
                out.append((m.group(1), m.group(2), s))
    return out


def _lookup(facts: list[tuple[str, str, int]], key: str) -> tuple[str, int]:
    hits = [(v, s) for k, v, s in facts if k == key]
    assert len(hits) == 1, f"key {key!r} occurs {len(hits)} times in the prompt"
    return hits[0]


def _fewshot_candidates(examples: list[tuple[str, str]]):
    rules = {"reverse": lambda w: w[::-1], "rotate": lambda w: w[1:] + w[:1],
             "rotate_right": lambda w: w[-1:] + w[:-1], "double": lambda w: "".join(c * 2 for c in w)}
    for k in range(26):
        rules[f"shift{k}"] = lambda w, k=k: "".join(chr((ord(c) - 97 + k) % 26 + 97) for c in w)
    table: dict[str, str] = {}
    if all(len(i) == len(o) for i, o in examples) and all(
            table.setdefault(a, b) == b for i, o in examples for a, b in zip(i, o)):
        rules["table"] = lambda w: "".join(table[c] for c in w) if all(c in table for c in w) else None
    return {name: fn for name, fn in rules.items() if all(fn(i) == o for i, o in examples)}


def solve(req: Request) -> tuple[str, set[int]]:
    """(answer, indices of the segments that hold the evidence) from the prompt text."""
    q = _question(req)
    if m := re.fullmatch(r"value of value of ([a-z0-9]+)\?", q):
        facts = _facts(req)
        middle, s1 = _lookup(facts, m.group(1))
        value, s2 = _lookup(facts, middle)
        return f"{middle}: {value}", {s1, s2}
    if m := re.fullmatch(r"value of ([a-z0-9]+)\?", q):
        answer, s1 = _lookup(_facts(req), m.group(1))
        return answer, {s1}
    if m := re.fullmatch(r"which keys are ([a-z]+)\?", q):
        facts = [f for f in _facts(req)]
        keys = [k for k, _, _ in facts]
        assert len(keys) == len(set(keys)), "duplicate keys in an aggregate prompt"
        hits = [(k, s) for k, v, s in facts if v == m.group(1)]
        return " ".join(k for k, _ in hits), {s for _, s in hits}
    assert re.fullmatch(r"[a-z]+", q), f"unrecognised question {q!r}"
    examples = [EXAMPLE_LINE.match(line).groups() for seg in req.segments[:-1]
                for line in seg.text.splitlines()]
    answers = {fn(q) for fn in _fewshot_candidates(examples).values()} - {None}
    assert len(answers) == 1, f"fewshot question {q!r} has answers {answers}"
    return answers.pop(), set(range(len(req.segments) - 1))


# ---------------------------------------------------------------- generation

@pytest.fixture(scope="module")
def tiny() -> dict[str, list[Request]]:
    return {task: generate(task, 300, seed=7) for task in TASKS}


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_gives_byte_identical_requests_and_other_seed_differs(task):
    a = [r.to_json() for r in iter_requests(task, 40, seed=3)]
    b = [r.to_json() for r in iter_requests(task, 40, seed=3)]
    c = [r.to_json() for r in iter_requests(task, 40, seed=4)]
    assert a == b
    assert a != c


def test_shorter_stream_is_a_prefix_of_a_longer_one():
    assert generate("rag", 10, seed=5) == generate("rag", 25, seed=5)[:10]


@pytest.mark.parametrize("task", TASKS)
def test_reference_solver_answers_every_tiny_request(tiny, task):
    for req in tiny[task]:
        answer, _ = solve(req)
        assert answer == req.answer, req.id
        assert score(req, answer + "\n") == 100.0


@pytest.mark.parametrize("task", TASKS)
def test_reference_solver_answers_every_bench_request(task):
    for req in generate(task, 8, seed=11, scale="bench"):
        assert solve(req)[0] == req.answer, req.id


@pytest.mark.parametrize("task", TASKS)
def test_reference_solver_answers_fresh_training_examples(task):
    rng = random.Random(123)
    for _ in range(100):
        req = sample_training_request(task, rng)
        assert solve(req)[0] == req.answer


def test_twohop_answers_need_two_different_segments(tiny):
    for req in tiny["twohop"] + [r for r in tiny["rag"] if "value of value" in r.segments[-1].text]:
        _, evidence = solve(req)
        assert len(evidence) == 2, req.id


def test_rag_mixes_fact_and_twohop_questions_after_a_system_prompt(tiny):
    kinds = collections.Counter("twohop" if "value of value" in r.segments[-1].text else "fact"
                                for r in tiny["rag"])
    assert kinds["fact"] > 50 and kinds["twohop"] > 50
    assert all(not r.segments[0].text.startswith("## doc") for r in tiny["rag"])
    system = collections.Counter(r.segments[0].text for r in tiny["rag"])
    (top, count), *_ = system.most_common()
    assert top.startswith("You answer questions")  # the rank-0 system prompt is the most popular
    assert count > 0.4 * len(tiny["rag"]) and len(system) == 3


@pytest.mark.parametrize("task", TASKS)
def test_only_the_last_segment_is_an_uncached_question(tiny, task):
    for req in tiny[task]:
        assert [s.cache for s in req.segments] == [True] * (len(req.segments) - 1) + [False]
        assert all(s.text.endswith("\n") for s in req.segments[:-1])
        assert req.answer and "\n" not in req.answer and req.answer == req.answer.strip()


@pytest.mark.parametrize("task", TASKS)
def test_tiny_examples_fit_1000_tokens_in_3_to_8_segments(tiny, task):
    stats = workload_stats(tiny[task])
    assert 250 <= stats.min_prompt_tokens and 450 <= stats.mean_prompt_tokens, stats
    assert all(r.prompt_tokens + len(r.answer) + 1 <= 1000 for r in tiny[task])
    assert all(3 <= len(r.segments) <= 8 for r in tiny[task])
    assert all(r.prompt.isascii() for r in tiny[task])
    rng = random.Random(5)
    assert all(len("".join(sample_training_example(task, rng))) <= 1000 for _ in range(200))


def test_max_tokens_redraws_long_requests_and_names_an_impossible_bound():
    reqs = generate("fewshot", 50, seed=0, max_tokens=450)
    assert all(r.prompt_tokens + len(r.answer) + 1 <= 450 for r in reqs)
    with pytest.raises(GenerationError, match="max_tokens=100"):
        generate("fact", 1, seed=0, max_tokens=100)


@pytest.mark.parametrize("task", TASKS)
def test_segments_recur_across_requests_in_varying_order(tiny, task):
    reqs = tiny[task]
    assert workload_stats(reqs).reuse_ratio > 0.5
    positions = collections.defaultdict(set)
    for req in reqs:
        for pos, seg in enumerate(req.segments[:-1]):
            positions[seg.text].add(pos)
    assert max(len(p) for p in positions.values()) >= 3  # a segment seen at several offsets


def test_zipf_makes_popular_segments_recur_more_than_uniform():
    def top_share(zipf: float) -> float:
        counts = collections.Counter(s.text for r in generate("fact", 300, seed=1, zipf=zipf)
                                     for s in r.segments[:-1])
        return counts.most_common(1)[0][1] / sum(counts.values())
    assert top_share(1.2) > 2 * top_share(0.0)


@pytest.mark.parametrize("task", ["fact", "twohop", "aggregate", "rag"])
def test_a_pool_document_always_has_the_same_text(tiny, task):
    texts = collections.defaultdict(set)
    for req in tiny[task]:
        for seg in req.segments[:-1]:
            if seg.text.startswith("## doc "):
                texts[seg.text.split("\n", 1)[0]].add(seg.text)
    assert texts and all(len(v) == 1 for v in texts.values())


def test_training_examples_are_fresh_content_ending_in_a_newline_target():
    pool_texts = {s.text for r in generate("fact", 300, seed=0) for s in r.segments}
    rng = random.Random(9)
    seen_tasks = collections.Counter()
    for _ in range(200):
        prompt, target = sample_training_example("mix", rng)
        assert prompt.endswith("\nA: ") and target.endswith(ANSWER_END) and target.count("\n") == 1
        assert not any(t in prompt for t in pool_texts if t.startswith("## doc"))
        seen_tasks[_kind(prompt)] += 1
    assert set(seen_tasks) == {"fact", "twohop", "aggregate", "fewshot"}
    assert sample_training_example("fact", random.Random(1)) == sample_training_example("fact", random.Random(1))


def _kind(prompt: str) -> str:
    q = prompt.rsplit("Q: ", 1)[1]
    return ("twohop" if q.startswith("value of value") else "fact" if q.startswith("value of")
            else "aggregate" if q.startswith("which keys") else "fewshot")


def test_bench_rag_prompts_average_about_12k_tokens():
    stats = workload_stats(generate("rag", 300, seed=0, scale="bench"))
    assert 11000 <= stats.mean_prompt_tokens <= 13000, stats
    assert 5 <= stats.mean_segments <= 12


def test_doc_tokens_and_docs_options_set_document_length_and_count():
    reqs = generate("fact", 20, seed=0, doc_tokens=400, docs="2-2")
    assert all(len(r.segments) == 3 for r in reqs)
    lengths = [len(s.text) for r in reqs for s in r.segments[:-1]]
    assert all(370 <= n <= 430 for n in lengths), lengths


# ---------------------------------------------------------------- config and records

def test_bad_parameters_are_rejected_with_the_value_named():
    with pytest.raises(UnknownTaskError, match="'summarize'"):
        generate("summarize", 1)
    with pytest.raises(WorkloadConfigError, match="docs_min=1"):
        make_config("twohop", docs="1-3")
    with pytest.raises(WorkloadConfigError, match="poolsize"):
        make_config("fact", poolsize=3)
    with pytest.raises(WorkloadConfigError, match="'7-3'"):
        make_config("fact", docs="7-3")
    with pytest.raises(WorkloadConfigError, match="pool_size=4"):
        make_config("fact", pool_size=4)


def test_request_json_round_trips_and_bad_records_name_the_field():
    req = generate("aggregate", 1, seed=2)[0]
    assert Request.from_json(req.to_json()) == req
    data = req.to_dict()
    del data["metric"]
    with pytest.raises(RecordFormatError, match="'metric'"):
        Request.from_dict(data)
    with pytest.raises(RecordFormatError, match="segment 0"):
        Request.from_dict({**req.to_dict(), "segments": [{"text": 3, "cache": True}]})


def test_read_requests_names_the_file_and_line_of_a_bad_record(tmp_path):
    path = tmp_path / "r.jsonl"
    reqs = generate("fewshot", 3, seed=0)
    assert write_requests(str(path), reqs) == 3
    assert read_requests(str(path)) == reqs
    with open(path, "a") as f:
        f.write('{"id": "broken"}\n')
    with pytest.raises(RecordFormatError, match=r"r.jsonl:4: .*'task'"):
        read_requests(str(path))


# ---------------------------------------------------------------- scoring

def test_exact_match_normalises_case_and_surrounding_space():
    assert exact_match("ab12", "  AB12 ") == 100.0
    assert exact_match("ab12", "ab13") == 0.0


def test_token_f1_counts_shared_tokens():
    assert token_f1("a b c d", "a b x") == pytest.approx(100 * 2 * (2 / 3) * (2 / 4) / (2 / 3 + 2 / 4))
    assert token_f1("a a b", "a b") == pytest.approx(100 * 2 * 1.0 * (2 / 3) / (1.0 + 2 / 3))
    assert token_f1("a", "") == 0.0 and token_f1("", "") == 100.0


def test_rouge_l_rewards_in_order_overlap_only():
    assert rouge_l("k1 k2 k3 k4", "k1 k3 k4") == pytest.approx(100 * 2 * 1.0 * 0.75 / 1.75)
    assert rouge_l("k1 k2 k3", "k3 k2 k1") == pytest.approx(100 / 3)
    assert rouge_l("k1 k2", "k1 k2") == 100.0 and rouge_l("k1", "zz") == 0.0


def test_score_uses_the_record_metric_and_the_first_generated_line():
    req = {"id": "x", "answer": "k1 k2 k3 k4", "metric": "rougeL"}
    assert score(req, "k1 k3 k4\nk2 garbage") == pytest.approx(rouge_l("k1 k2 k3 k4", "k1 k3 k4"))
    assert score({"answer": "ab", "metric": "em"}, "ab\nmore") == 100.0
    assert first_line("xy\nz") == "xy"
    with pytest.raises(RecordFormatError, match="'bleu'"):
        score({"answer": "a", "metric": "bleu"}, "a")


# ---------------------------------------------------------------- CLI

def _cli(*args: str, hash_seed: str = "0") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "tools.workloads", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_writes_engine_request_jsonl_identically_under_any_hash_seed(tmp_path):
    out = tmp_path / "fact.jsonl"
    proc = _cli("twohop", "--n", "12", "--seed", "3", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 12
    for line in lines:
        rec = json.loads(line)
        assert isinstance(rec["id"], str) and rec["task"] == "twohop" and rec["metric"] == "em"
        assert all(set(s) == {"text", "cache"} for s in rec["segments"])
        assert rec["segments"][-1]["cache"] is False
    assert read_requests(str(out)) == generate("twohop", 12, seed=3)
    again = tmp_path / "again.jsonl"
    assert _cli("twohop", "--n", "12", "--seed", "3", "-o", str(again), hash_seed="12345").returncode == 0
    assert again.read_bytes() == out.read_bytes()


def test_cli_all_with_out_dir_and_stats_table(tmp_path):
    proc = _cli("all", "--n", "20", "--seed", "1", "--out-dir", str(tmp_path), "--stats")
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.splitlines()
    assert rows[0].split()[:2] == ["task", "requests"]
    assert [r.split()[0] for r in rows[1:]] == list(TASKS)
    for task in TASKS:
        recs = [json.loads(x) for x in (tmp_path / f"{task}.jsonl").read_text().splitlines()]
        assert len(recs) == 20 and {r["task"] for r in recs} == {task}


def test_cli_reports_bad_options_and_exits_2():
    proc = _cli("fact", "--docs", "9-2", "--stats")
    assert proc.returncode == 2 and "9-2" in proc.stderr
