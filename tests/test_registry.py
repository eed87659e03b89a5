"""Every extension point's registry, every member: it resolves, has a docstring, its name is unique
and (for a class with a ``name``) its own; an unknown name is one clear user error."""

import pytest

from eventkv.errors import EventKVError, OptionError
from eventkv.options import BACKENDS, CARRIER_KINDS, DIALOGUE_FORMATS, POLICIES, SELECTORS
from eventkv.probes.base import PROBES
from eventkv.registry import Registry

REGISTRIES = {
    "probe": PROBES,
    "eviction policy": POLICIES,
    "sweep backend": BACKENDS,
    "dialogue format": DIALOGUE_FORMATS,
    "carrier kind": CARRIER_KINDS,
    "selector": SELECTORS,
}
MEMBERS = [(kind, name) for kind, reg in REGISTRIES.items() for name in reg.names()]


@pytest.mark.parametrize("kind, name", MEMBERS, ids=[f"{k}:{n}" for k, n in MEMBERS])
def test_every_member_resolves_and_is_documented(kind, name):
    reg = REGISTRIES[kind]
    member = reg.get(name)
    assert member is reg.get(name) and name in reg
    assert (member.__doc__ or "").strip(), f"{kind} {name!r} has no docstring"
    own = getattr(member, "name", name)
    assert own == name, f"{kind} {name!r} resolves to a member that calls itself {own!r}"


@pytest.mark.parametrize("kind", REGISTRIES)
def test_names_are_unique_and_listed(kind):
    reg = REGISTRIES[kind]
    names = reg.names()
    assert names and len(set(names)) == len(names) == len(reg)
    assert list(reg) == list(names)


@pytest.mark.parametrize(
    "reg, message",
    [
        (PROBES, "unknown probe 'nope': use one of "),
        (
            POLICIES,
            "--policy 'nope': use one of streaming, knorm, snapkv, tova, expected, random, event-topk, observed,",
        ),
        (BACKENDS, "--backend 'nope': use one of serial, process, ray."),
        (DIALOGUE_FORMATS, "--format 'nope': use locomo or realtalk."),
        (CARRIER_KINDS, "--kind 'nope': use one of passive, binding, directive, compute or auto."),
        (SELECTORS, "--selector 'nope': give one of attention, bm25, dense, hybrid, rerank, or a Selector."),
    ],
    ids=list(REGISTRIES),
)
def test_an_unknown_name_is_one_clear_error(reg, message):
    with pytest.raises(EventKVError) as exc:
        reg.get("nope")
    shown = exc.value.for_cli() if isinstance(exc.value, OptionError) else str(exc.value)
    assert shown.startswith(message), shown
    assert all(n in shown for n in reg.names())


def test_lazy_members_are_imported_on_first_use_only():
    reg = Registry("thing", {"late": "eventkv.tests_never_imported:thing"}, field="thing")
    assert reg.names() == ("late",)  # listing imports nothing
    with pytest.raises(ModuleNotFoundError):
        reg.get("late")


def test_a_name_is_registered_once():
    reg = Registry("thing")

    @reg.register("one")
    def one():
        """The first."""

    assert reg.get("one") is one and reg.put("one", one) is one  # the same member again: nothing changes
    with pytest.raises(ValueError, match="thing name 'one' is already registered"):
        reg.put("one", lambda: None)
    with pytest.raises(ValueError, match="already registered"):
        reg.add("one", "eventkv.errors:EventKVError")
    with pytest.raises(EventKVError, match=r"unknown thing 'two': use one of one\."):
        reg.get("two")


def test_third_party_probes_come_from_the_entry_point_group():
    from importlib.metadata import entry_points

    assert PROBES.entry_points == "eventkv.probes"
    assert {ep.name for ep in entry_points(group="eventkv.probes")} <= set(PROBES.names())
