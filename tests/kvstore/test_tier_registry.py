"""kvstore.tiers.registry: the ordered tier table the Store, Placement and WriteBack ask
for roles instead of naming tiers; a Store built from it on real media (shared-memory
arena, files, LMDB) with one tier or two; and a source check that the store's logic
(the remote tier's included) names no tier."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvstore.config import OPTIONS_BY_NAME
from kvstore.errors import InvalidRequest
from kvstore.records import ObjectMeta
from kvstore.store import Store
from kvstore.tiers.registry import TIERS

from storeutil import PAGE, get_bytes, make_settings, put

ROOT = Path(__file__).resolve().parents[2]


def test_the_registry_lists_the_tiers_fastest_first_with_their_capabilities():
    assert TIERS.names == ("gpu", "cpu", "nvme")  # the order demotion follows; names are the wire's
    assert [TIERS.rank(n) for n in TIERS.names] == [0, 1, 2]
    caps = {s.name: (s.host_mapped, s.device, s.durable) for s in TIERS}
    assert caps == {"gpu": (False, True, False), "cpu": (True, False, False), "nvme": (False, False, True)}
    assert OPTIONS_BY_NAME["default_tier"].choices == TIERS.names  # the config registry reads the same table


def test_unknown_tiers_are_refused_with_the_choices():
    with pytest.raises(InvalidRequest, match=r"unknown tier 'ssd'; choose from gpu, cpu, nvme"):
        TIERS.check("ssd")
    with pytest.raises(InvalidRequest, match="unknown tier"):
        TIERS.roles(["cpu", "ssd"])
    with pytest.raises(InvalidRequest, match=r"unknown default tier 'tape'"):
        Store(make_settings(Path("/nonexistent"), default_tier="tape"))


@pytest.mark.parametrize("enabled, memory, durable, below_cpu", [
    (("gpu", "cpu", "nvme"), "cpu", "nvme", "nvme"),
    (("nvme", "cpu"), "cpu", "nvme", "nvme"),  # any order in, the registry's order out
    (("cpu",), "cpu", None, None),
    (("nvme",), None, "nvme", None),
    (("gpu", "cpu"), "cpu", None, None),
])
def test_roles_follow_the_enabled_tiers(enabled, memory, durable, below_cpu):
    roles = TIERS.roles(enabled)
    assert roles.order == tuple(n for n in TIERS.names if n in enabled)
    assert (roles.memory, roles.durable) == (memory, durable)
    assert roles.can_write_back == (memory is not None and durable is not None)
    if "cpu" in enabled:
        assert roles.below("cpu") == below_cpu


def test_capacities_and_enabled_tiers_come_from_the_settings(tmp_path):
    s = make_settings(tmp_path, cpu_capacity=4 * PAGE, nvme_capacity=0)
    assert TIERS.capacities(s) == [("gpu", 0), ("cpu", 4 * PAGE), ("nvme", 0)]
    assert TIERS.enabled(s) == ("cpu",)
    built = TIERS.build(s, tmp_path)
    assert [t.name for t in built] == ["cpu"] and built[0].capacity == 4 * PAGE


def test_a_store_with_only_a_durable_tier_serves_from_it_and_promotes_nowhere(tmp_path):
    with Store(make_settings(tmp_path, cpu_capacity=0)) as s:
        assert s.roles.memory is None and s.roles.durable == "nvme"
        put(s, b"k", b"x" * 3000, tier="nvme")
        assert get_bytes(s, b"k") == b"x" * 3000  # promote=True, but there is no memory tier
        assert s.object_info(b"k").tier == "nvme"
        assert s.write_back_round(0.0, 1 << 20, 3) == 0  # nothing to back, nowhere to back it from
    with Store(make_settings(tmp_path, cpu_capacity=0)) as s:  # durable: back after a restart
        assert get_bytes(s, b"k") == b"x" * 3000


def test_a_memory_only_store_demotes_by_dropping_and_backs_nothing(tmp_path):
    with Store(make_settings(tmp_path, cpu_capacity=2 * PAGE, nvme_capacity=0)) as s:
        assert s.roles.memory == "cpu" and s.roles.durable is None
        put(s, b"a", b"a" * PAGE)
        put(s, b"b", b"b" * PAGE)
        put(s, b"c", b"c" * PAGE)  # no tier below: making room drops the oldest (lru)
        assert s.write_back_round(0.0, 1 << 20, 3) == 0
        st = s.stats()
        assert st["evictions"] == 1 and st["demotions"] == 0 and st["objects"] == 2
        assert s.reserve(b"d", 10, "cpu", ObjectMeta()).status == "reserved"


def test_the_write_back_round_is_public_and_backs_memory_objects_in_the_durable_tier(tmp_path):
    with Store(make_settings(tmp_path, cpu_capacity=4 * PAGE)) as s:
        for k in (b"a", b"b", b"c"):
            put(s, k, k * PAGE)
        assert s.write_back_round(0.0, 1 << 30, 3) == 3
        assert [i.backed for i in s.list_objects(tier="cpu")] == [True, True, True]
        assert s.write_back_round(0.0, 1 << 30, 3) == 0  # all backed


def _names_in_logic(path: Path) -> list[str]:
    """Tier-name string literals in a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [f"{path.name}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in TIERS.names and id(n) not in docstrings]


REMOTE = sorted(str(p.relative_to(ROOT / "kvstore")) for p in (ROOT / "kvstore" / "remote").glob("*.py"))


@pytest.mark.parametrize("module", ["store.py", "placement.py", "writeback.py", "storemedia.py", "reservations.py",
                                    *REMOTE])
def test_the_store_logic_names_no_tier(module):
    assert _names_in_logic(ROOT / "kvstore" / module) == []


def test_the_remote_tier_reaches_the_store_through_public_names_only():
    """kvstore/remote/ uses no private attribute of the Store (`store._x`)."""
    bad = []
    for rel in REMOTE:
        tree = ast.parse((ROOT / "kvstore" / rel).read_text())
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                    and isinstance(n.value, (ast.Name, ast.Attribute))
                    and (n.value.id if isinstance(n.value, ast.Name) else n.value.attr) in ("store", "s")):
                bad.append(f"{rel}:{n.lineno}: .{n.attr}")
    assert REMOTE and bad == []
