"""mtc.orbax_handlers alone: Orbax's ``item_handlers`` as mtc reads them (the items
they name, the args each takes) and the typed refusals; Orbax's own handler
objects, no manager, no process."""

from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp
import pytest

from mtc import orbax_handlers
from mtc.errors import ConfigError

STATE = {"w": [1.0, 2.0]}


@pytest.mark.parametrize(("handlers", "names", "want"), [
    (None, None, (None, None)),
    (None, ("a",), (None, ("a",))),
    (ocp.StandardCheckpointHandler(), None, ({None: "StandardCheckpointHandler"}, None)),
    ({"params": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}, None,
     ({"params": "PyTreeCheckpointHandler", "meta": "JsonCheckpointHandler"},
      ("params", "meta"))),
    # item_names and a dict: the names first, then items only the dict names
    ({"meta": ocp.JsonCheckpointHandler()}, ("params", "meta"),
     ({"meta": "JsonCheckpointHandler"}, ("params", "meta", ))),
    ({"arr": ocp.ArrayCheckpointHandler()}, ("params",),
     ({"arr": "ArrayCheckpointHandler"}, ("params", "arr"))),
], ids=["none", "names only", "one handler", "a dict", "a dict beside names",
        "a dict adds a name"])
def test_what_item_handlers_say(handlers: Any, names: Any, want: Any) -> None:
    assert orbax_handlers.read(handlers, names) == want


class MyHandler(ocp.PyTreeCheckpointHandler):
    """A user's own handler: mtc would not run it."""


@pytest.mark.parametrize(("handlers", "names", "match"), [
    (ocp.StandardCheckpointHandler(), ("params",), "should not be provided together"),
    (MyHandler(), None, "MyHandler is not a handler mtc reads"),
    ({"params": MyHandler()}, None, r"item_handlers\['params'\]: .*MyHandler"),
    ({"": ocp.JsonCheckpointHandler()}, None, "keys are item names"),
], ids=["one handler beside names", "a handler of the user's", "one in a dict",
        "an empty name"])
def test_item_handlers_mtc_cannot_honour_are_refused(handlers: Any, names: Any,
                                                    match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        orbax_handlers.read(handlers, names)
    assert isinstance(e.value, ValueError)  # as Orbax refuses them


def test_args_an_items_handler_does_not_take_are_refused() -> None:
    one, _ = orbax_handlers.read(ocp.PyTreeCheckpointHandler(), None)
    orbax_handlers.check(one, ocp.args.PyTreeSave(STATE), "save")
    orbax_handlers.check(one, ocp.args.PyTreeRestore(), "restore")
    with pytest.raises(ConfigError, match=r"args StandardSaveArgs does not match with any "
                                          "registered handler.*PyTreeCheckpointHandler"):
        orbax_handlers.check(one, ocp.args.StandardSave(STATE), "save")
    by_item, _ = orbax_handlers.read({"params": ocp.StandardCheckpointHandler(),
                                      "meta": ocp.JsonCheckpointHandler()}, None)
    orbax_handlers.check(by_item, ocp.args.Composite(
        params=ocp.args.StandardSave(STATE), meta=ocp.args.JsonSave({"n": 1}),
        other=ocp.args.PyTreeSave(STATE)), "save")  # an item without a handler: any
    orbax_handlers.check(by_item, ocp.args.Composite(params=None), "restore")  # as saved
    with pytest.raises(ConfigError, match="restore\\(\\): Item 'meta' and args "
                                          "StandardRestoreArgs does not match"):
        orbax_handlers.check(by_item, ocp.args.Composite(
            params=ocp.args.StandardRestore(), meta=ocp.args.StandardRestore()), "restore")
    orbax_handlers.check(None, ocp.args.StandardSave(STATE), "save")  # no handlers given
