"""The backend registry: entry points, in-process registration, environment, errors.

Every test builds its own :class:`moe_ep_spec.Registry` with an explicit
``environ``; the process-wide registry is never touched.
"""

from __future__ import annotations

import itertools
import re
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

import moe_ep_spec
from moe_ep_spec import (
    Availability,
    BackendError,
    BackendNotFoundError,
    BackendUnavailableError,
    MoeEpBackend,
    MoeEpError,
    PluginFailure,
    Registry,
)
from moe_ep_spec.hookspecs import ENTRY_POINT_GROUP

ROOT = Path(__file__).resolve().parents[1]
NAME_PATTERN = "[a-z0-9][a-z0-9_-]* (lowercase)"


class DummyBackend(MoeEpBackend):
    version = "9.9"

    def __init__(self, name, available=True, reason=""):
        self.name = name
        self._availability = Availability(available, reason)

    def availability(self):
        return self._availability


def isolated(**env):
    """A registry that loads no installed plugin (unless env says otherwise)."""
    environ = {"MOE_EP_LOAD_PLUGINS": ""}
    environ.update(env)
    return Registry(environ=environ)


# ============================================================================ in-process


def test_in_process_backend_is_found():
    reg = isolated()
    b = DummyBackend("alpha")
    assert reg.register(b) is b
    assert reg.get_backend("alpha") is b
    assert reg.names() == ["alpha"]
    assert reg.list_backends() == [b]
    assert reg.source("alpha") == "in-process"
    assert reg.failures() == ()
    assert b.distribution is None


def test_list_backends_sorted_and_unregister():
    reg = isolated()
    for n in ("zeta", "alpha", "mid"):
        reg.register(DummyBackend(n))
    assert reg.names() == ["alpha", "mid", "zeta"]
    assert [b.name for b in reg.list_backends()] == ["alpha", "mid", "zeta"]
    reg.unregister("mid")
    reg.unregister("not-there")  # no error
    assert reg.names() == ["alpha", "zeta"]
    with pytest.raises(BackendNotFoundError):
        reg.get_backend("mid")


def test_registries_are_independent():
    a, b = isolated(), isolated()
    a.register(DummyBackend("only-a"))
    assert b.names() == []
    assert "only-a" not in moe_ep_spec.Registry(environ={"MOE_EP_LOAD_PLUGINS": ""}).names()


def test_in_process_pluggy_plugin():
    class Plugin:
        @moe_ep_spec.hookimpl
        def register_backends(self, register):
            register(DummyBackend("from-plugin"))
            register(DummyBackend("from-plugin-2"))

    reg = isolated()
    reg.register_plugin(Plugin(), name="my-plugin")
    assert reg.names() == ["from-plugin", "from-plugin-2"]
    assert reg.source("from-plugin") == "my-plugin"


def test_in_process_plugin_failure_is_raised_not_recorded():
    class Broken:
        @moe_ep_spec.hookimpl
        def register_backends(self, register):
            raise KeyError("nope")

    reg = isolated()
    with pytest.raises(KeyError, match="nope"):
        reg.register_plugin(Broken(), name="broken")
    assert reg.failures() == ()
    assert reg.names() == []


# ============================================================================ installed entry point


def test_project_declares_reference_entry_point():
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["entry-points"][ENTRY_POINT_GROUP]["reference"] == "moe_ep_reference.plugin"
    eps = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert eps["reference"].value == "moe_ep_reference.plugin"


def test_installed_reference_is_found_when_plugins_unset():
    reg = Registry(environ={})  # MOE_EP_LOAD_PLUGINS unset: every installed plugin
    assert "reference" in reg.names()
    ref = reg.get_backend("reference")
    assert type(ref).__name__ == "ReferenceBackend" and ref.name == "reference"
    assert reg.source("reference") == "reference"
    assert ref.distribution == "moe-ep-spec"
    assert reg.get_backend() is ref  # the default name


def test_load_plugins_empty_loads_none():
    reg = Registry(environ={"MOE_EP_LOAD_PLUGINS": ""})
    assert reg.names() == []
    assert reg.failures() == ()
    with pytest.raises(BackendNotFoundError, match=re.escape(
        "no MoeEp backend named 'reference'; registered backends: (none)"
    )):
        reg.get_backend()
    # in-process registration still works
    reg.register(DummyBackend("alpha"))
    assert reg.names() == ["alpha"]


@pytest.mark.filterwarnings("ignore::moe_ep_spec.MoeEpWarning")  # 'not-installed' is named by its own test
@pytest.mark.parametrize("allow", ["reference", " reference , not-installed ", "moe-ep-spec", ",reference,"])
def test_load_plugins_allow_list(allow):
    reg = Registry(environ={"MOE_EP_LOAD_PLUGINS": allow})
    assert reg.names() == ["reference"]
    assert reg.failures() == ()
    assert reg.get_backend("reference").name == "reference"


def test_load_plugins_allow_list_without_match_loads_none():
    reg = Registry(environ={"MOE_EP_LOAD_PLUGINS": "something-else"})
    with pytest.warns(moe_ep_spec.MoeEpWarning, match="'something-else'"):
        assert reg.names() == []


def test_load_plugins_allow_list_normalises_distribution_names():
    reg = Registry(environ={"MOE_EP_LOAD_PLUGINS": "moe_ep_spec"})
    assert reg.names() == ["reference"]


def test_load_entry_points_false_loads_none():
    reg = Registry(load_entry_points=False, environ={})
    assert reg.names() == []


# ============================================================================ lookup errors


def test_unknown_name_lists_registered_and_suggests_closest():
    reg = isolated(MOE_EP_LOAD_PLUGINS="reference")
    reg.register(DummyBackend("alpha"))
    msg = "no MoeEp backend named 'referense'; registered backends: alpha, reference. Did you mean 'reference'?"
    with pytest.raises(BackendNotFoundError, match="^" + re.escape(msg) + "$") as ei:
        reg.get_backend("referense")
    err = ei.value
    assert err.name == "referense" and err.registered == ("alpha", "reference") and err.suggestion == "reference"
    assert str(err) == msg  # not quoted like a KeyError
    assert isinstance(err, LookupError) and isinstance(err, BackendError) and isinstance(err, MoeEpError)


def test_unknown_name_suggestion_is_case_insensitive_and_optional():
    reg = isolated()
    reg.register(DummyBackend("alpha"))
    reg.register(DummyBackend("torch-nccl"))
    with pytest.raises(BackendNotFoundError, match=re.escape("Did you mean 'torch-nccl'?")) as ei:
        reg.get_backend("TORCH-NCCL")
    assert ei.value.suggestion == "torch-nccl"
    with pytest.raises(BackendNotFoundError, match="^" + re.escape(
        "no MoeEp backend named 'qqqqqqq'; registered backends: alpha, torch-nccl"
    ) + "$") as ei:
        reg.get_backend("qqqqqqq")
    assert ei.value.suggestion is None


def test_env_backend_picks_default():
    reg = isolated(MOE_EP_BACKEND="beta")
    a, b = DummyBackend("alpha"), DummyBackend("beta")
    reg.register(a)
    reg.register(b)
    assert reg.default_name() == "beta"
    assert reg.get_backend() is b
    assert reg.get_backend("alpha") is a  # an explicit name wins


def test_default_name_without_env():
    assert isolated().default_name() == "reference"
    assert isolated(MOE_EP_BACKEND="").default_name() == "reference"


def test_env_backend_unknown():
    reg = isolated(MOE_EP_BACKEND="alphx")
    reg.register(DummyBackend("alpha"))
    with pytest.raises(BackendNotFoundError, match=re.escape(
        "no MoeEp backend named 'alphx' (the name came from the environment variable MOE_EP_BACKEND); "
        "registered backends: alpha. Did you mean 'alpha'?"
    )) as ei:
        reg.get_backend()
    assert ei.value.origin == "the environment variable MOE_EP_BACKEND"
    with pytest.raises(BackendNotFoundError, match="^no MoeEp backend named 'alphx'; "):
        reg.get_backend("alphx")  # a name passed in is not attributed to the variable


def test_backend_not_found_survives_pickling():
    import pickle

    err = BackendNotFoundError("x", ["a"], None, origin="the environment variable MOE_EP_BACKEND", note="a note")
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err) and copy.origin == err.origin and copy.note == "a note"


def test_load_plugins_entry_that_matches_nothing_is_named():
    reg = Registry(environ={"MOE_EP_LOAD_PLUGINS": "reference,nosuch"})
    with pytest.warns(moe_ep_spec.MoeEpWarning, match="MOE_EP_LOAD_PLUGINS names 'nosuch', which matches no installed"):
        assert reg.names() == ["reference"]
    assert reg.unmatched_plugins() == ("nosuch",)
    assert "reference (moe-ep-spec)" in reg.unmatched_plugins_message()
    with pytest.raises(BackendNotFoundError, match="MOE_EP_LOAD_PLUGINS names 'nosuch'"):
        reg.get_backend("torch")
    assert Registry(environ={"MOE_EP_LOAD_PLUGINS": "reference"}).unmatched_plugins() == ()


def test_load_plugins_excluding_an_installed_backend_says_so():
    reg = Registry(environ={"MOE_EP_LOAD_PLUGINS": "moe-ep-spec"})
    installed = {p.name for p in reg.installed_plugins()}
    other = sorted(installed - {"reference"})
    if not other:
        pytest.skip("only the reference is installed")
    with pytest.raises(BackendNotFoundError, match=f"the installed plugin '{other[0]}' is not among them"):
        reg.get_backend(other[0])


def test_unavailable_backend():
    reg = isolated(MOE_EP_BACKEND="gpu-only")
    b = DummyBackend("gpu-only", available=False, reason="no CUDA device visible")
    reg.register(b)
    msg = "MoeEp backend 'gpu-only' is not available: no CUDA device visible"
    with pytest.raises(BackendUnavailableError, match="^" + re.escape(msg) + "$") as ei:
        reg.get_backend("gpu-only")
    assert ei.value.name == "gpu-only" and ei.value.reason == "no CUDA device visible"
    assert isinstance(ei.value, RuntimeError) and isinstance(ei.value, BackendError)
    with pytest.raises(BackendUnavailableError, match=re.escape(msg)):
        reg.get_backend()  # the default goes through the same check
    assert reg.get_backend("gpu-only", require_available=False) is b
    assert b in reg.list_backends()  # listed although unavailable
    assert b.is_available() is False


# ============================================================================ name rules


def test_duplicate_names_rejected():
    reg = isolated(MOE_EP_LOAD_PLUGINS="reference")
    first = DummyBackend("alpha")
    reg.register(first)
    with pytest.raises(ValueError, match=re.escape("backend name 'alpha' is already registered by 'in-process'")):
        reg.register(DummyBackend("alpha"))
    with pytest.raises(ValueError, match=re.escape("backend name 'reference' is already registered by 'reference'")):
        reg.register(DummyBackend("reference"))
    assert reg.get_backend("alpha") is first
    assert type(reg.get_backend("reference")).__name__ == "ReferenceBackend"


@pytest.mark.parametrize("name", ["Bad", "", "-x", "_x", "a b", "a.b", "caf\u00e9", "a/b", 5, None, b"abc"])
def test_invalid_names_rejected(name):
    reg = isolated()
    with pytest.raises(ValueError, match="^" + re.escape(f"backend name must match {NAME_PATTERN}; got {name!r}") + "$"):
        reg.register(DummyBackend(name))
    assert reg.names() == []


@pytest.mark.parametrize("name", ["a", "0", "my_backend-2", "torch-nccl", "x" * 100])
def test_valid_names_accepted(name):
    reg = isolated()
    reg.register(DummyBackend(name))
    assert reg.names() == [name]


def test_name_with_trailing_newline_rejected():
    reg = isolated()
    with pytest.raises(ValueError, match="backend name must match"):
        reg.register(DummyBackend("alpha\n"))


def test_register_rejects_non_backend():
    reg = isolated()
    with pytest.raises(TypeError, match=re.escape(
        "register() takes a moe_ep_spec.MoeEpBackend instance; got object"
    )):
        reg.register(object())  # type: ignore[arg-type]


# ============================================================================ broken plugins, real entry points

_counter = itertools.count()

_GOOD = """
import moe_ep_spec


class GoodBackend(moe_ep_spec.MoeEpBackend):
    name = "tmp-good"
    version = "1.2.3"


@moe_ep_spec.hookimpl
def register_backends(register):
    register(GoodBackend())
"""

_IMPORT_FAILS = """
raise RuntimeError("boom at import")
"""

_HOOK_FAILS = """
import moe_ep_spec


@moe_ep_spec.hookimpl
def register_backends(register):
    raise ValueError("boom in hook")
"""

_DUPLICATE = """
import moe_ep_spec


class Dup(moe_ep_spec.MoeEpBackend):
    name = "reference"


@moe_ep_spec.hookimpl
def register_backends(register):
    register(Dup())
"""

_NOT_A_BACKEND = """
import moe_ep_spec


@moe_ep_spec.hookimpl
def register_backends(register):
    register(object())
"""


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """A throwaway installed distribution ``moe-ep-test-plugins`` with five entry
    points in the backend group: one good, four broken in different ways, plus
    one pointing at a module that does not exist."""
    sfx = f"{next(_counter)}_{abs(hash(str(tmp_path))) % 10**8}"
    mods = {
        f"moe_ep_t{sfx}_good": _GOOD,
        f"moe_ep_t{sfx}_import_fails": _IMPORT_FAILS,
        f"moe_ep_t{sfx}_hook_fails": _HOOK_FAILS,
        f"moe_ep_t{sfx}_duplicate": _DUPLICATE,
        f"moe_ep_t{sfx}_not_a_backend": _NOT_A_BACKEND,
    }
    for mod, src in mods.items():
        (tmp_path / f"{mod}.py").write_text(textwrap.dedent(src))
    info = tmp_path / "moe_ep_test_plugins-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: moe-ep-test-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        f"tmp-good = moe_ep_t{sfx}_good\n"
        f"broken-import = moe_ep_t{sfx}_import_fails\n"
        f"broken-hook = moe_ep_t{sfx}_hook_fails\n"
        f"zz-duplicate = moe_ep_t{sfx}_duplicate\n"
        f"not-a-backend = moe_ep_t{sfx}_not_a_backend\n"
        f"missing-module = moe_ep_t{sfx}_does_not_exist\n"
        "\n[console_scripts]\nunrelated = nothing:here\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield mods
    for mod in list(sys.modules):
        if mod.startswith(f"moe_ep_t{sfx}_"):
            del sys.modules[mod]


_FAKE_ALLOW = "reference,tmp-good,broken-import,broken-hook,zz-duplicate,not-a-backend,missing-module"


def test_fake_distribution_is_visible_to_importlib_metadata(fake_dist):
    eps = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert {"tmp-good", "broken-import", "broken-hook", "zz-duplicate", "not-a-backend", "missing-module"} <= set(eps)
    assert eps["tmp-good"].dist.name == "moe-ep-test-plugins"


def test_broken_plugins_are_recorded_and_others_load(fake_dist):
    reg = Registry(environ={"MOE_EP_LOAD_PLUGINS": _FAKE_ALLOW})
    assert reg.names() == ["reference", "tmp-good"]
    good = reg.get_backend("tmp-good")
    assert type(good).__name__ == "GoodBackend" and good.version == "1.2.3"
    assert good.distribution == "moe-ep-test-plugins"
    assert reg.source("tmp-good") == "tmp-good"
    assert reg.get_backend("reference").distribution == "moe-ep-spec"

    failures = {f.name: f for f in reg.failures()}
    assert set(failures) == {"broken-import", "broken-hook", "zz-duplicate", "not-a-backend", "missing-module"}
    for f in failures.values():
        assert isinstance(f, PluginFailure)
        assert f.distribution == "moe-ep-test-plugins"
        assert f.traceback.startswith("Traceback")

    imp = failures["broken-import"]
    assert imp.stage == "import"
    assert type(imp.exception) is RuntimeError and str(imp.exception) == "boom at import"
    assert "boom at import" in imp.traceback
    assert str(imp) == (
        "plugin 'broken-import' (distribution moe-ep-test-plugins) failed at import: RuntimeError: boom at import"
    )

    hook = failures["broken-hook"]
    assert hook.stage == "register"
    assert type(hook.exception) is ValueError and str(hook.exception) == "boom in hook"
    assert str(hook) == (
        "plugin 'broken-hook' (distribution moe-ep-test-plugins) failed at register: ValueError: boom in hook"
    )

    dup = failures["zz-duplicate"]
    assert dup.stage == "register" and isinstance(dup.exception, ValueError)
    assert str(dup.exception) == "backend name 'reference' is already registered by 'reference'"
    assert type(reg.get_backend("reference")).__name__ == "ReferenceBackend"  # the first one stays

    nab = failures["not-a-backend"]
    assert nab.stage == "register" and isinstance(nab.exception, TypeError)
    assert str(nab.exception) == "register() takes a moe_ep_spec.MoeEpBackend instance; got object"

    miss = failures["missing-module"]
    assert miss.stage == "import" and isinstance(miss.exception, ModuleNotFoundError)

    for broken in ("broken-import", "broken-hook", "not-a-backend"):
        with pytest.raises(BackendNotFoundError):
            reg.get_backend(broken)


def test_broken_plugins_loaded_when_plugins_unset(fake_dist):
    reg = Registry(environ={})
    assert {"reference", "tmp-good"} <= set(reg.names())
    names = {f.name for f in reg.failures()}
    assert {"broken-import", "broken-hook", "zz-duplicate", "not-a-backend", "missing-module"} <= names


def test_allow_list_by_distribution_name_and_exclusion(fake_dist):
    reg = Registry(environ={"MOE_EP_LOAD_PLUGINS": "moe-ep-test-plugins"})
    # the project's own 'reference' entry point is excluded; the fake distribution's
    # 'zz-duplicate' plugin then registers its backend under that free name
    assert reg.names() == ["reference", "tmp-good"]
    assert type(reg.get_backend("reference")).__name__ == "Dup"
    assert reg.source("reference") == "zz-duplicate"
    assert reg.get_backend("reference").distribution == "moe-ep-test-plugins"
    assert {f.name for f in reg.failures()} == {"broken-import", "broken-hook", "not-a-backend", "missing-module"}

    only_good = Registry(environ={"MOE_EP_LOAD_PLUGINS": "tmp-good"})
    assert only_good.names() == ["tmp-good"] and only_good.failures() == ()

    none = Registry(environ={"MOE_EP_LOAD_PLUGINS": ""})
    assert none.names() == [] and none.failures() == ()
