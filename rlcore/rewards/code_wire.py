"""The wire between the code reward's two sandboxes: a tagged encoding of plain data, remote proxies,
and the two harnesses (`serve`: the program's side, `run_test`: the test's side).

Standard library only: code_rpc.py embeds this file's source in each sandbox's main.py, and the
scorer imports it to decode a call's result. Messages are single JSON lines; every value is tagged:

    ["n"]  ["b", true]  ["i", "-1f"] (hex)  ["f", "inf"]  ["c", "1.0", "-2.0"]  ["s", "text"]
    ["y", "00ff"] (hex)  ["l", [...]]  ["t", [...]]  ["S", [...]]  ["F", [...]]  ["d", [[k, v], ...]]
    ["r", 7]  a reference to an object that is not plain data (it stays in the program's sandbox)

`decode` builds exact builtin types only (never pickle, never eval), bounds nesting (`MAX_DEPTH`)
and size (`MAX_ITEMS`), and refuses anything else with `WireError`. `encode` sends an instance of a
subclass of a plain type (Counter, namedtuple, IntEnum, an `int` whose `__eq__` always says yes) as
its base type's plain value.

A request is `[op, ref, payload]` (ops: call, getattr, getitem, len, bool, iter, str, repr); the
answer `["ok", value]` or `["err", type name, message]`. The program's side first sends
`["hello", [[name, ref], ...]]` (its module's names), or `["failed", type name]` when loading it raised.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import sys
import traceback

MAX_DEPTH = 100
MAX_ITEMS = 200_000
MAX_NAMES = 4096
PASS = ["pass"]
_SCALARS = {type(None): "n", bool: "b", int: "i", float: "f", complex: "c", str: "s", bytes: "y"}
_CONTAINERS = {list: "l", tuple: "t", set: "S", frozenset: "F", dict: "d"}
_BUILD = {"l": list, "t": tuple, "S": set, "F": frozenset, "d": dict}
_FLOAT_TEXT = 40  # longest float text accepted ("-2.2250738585072014e-308" is 24)
_NOT_MAPPED = ("StopIteration", "StopAsyncIteration")  # would end the test's loops, not fail them


class WireError(ValueError):
    """A value that cannot be sent, or a message that is not valid tagged data (refused)."""


class Broken(BaseException):  # not an Exception: no test's `except` swallows it
    """The channel to the program failed: no test passes after this."""


class RemoteError(Exception):
    """The program raised (its exception type's name is in the message; a builtin type is also a base)."""


def encode(value, ref, depth=0):
    """`value` as tagged data; an object that is not plain data becomes ["r", ref(obj)] (WireError if ref is None)."""
    base = next((t for t in type(value).__mro__ if t in _SCALARS or t in _CONTAINERS), None)
    if base is None:
        if ref is None:
            raise WireError(f"a {type(value).__name__} is not plain data")
        return ["r", ref(value)]
    if base is not type(value):
        value = base(value.items() if base is dict else value)
    if base in _SCALARS:
        return _encode_scalar(value)
    if depth >= MAX_DEPTH:
        raise WireError(f"nested deeper than {MAX_DEPTH}")
    if base is dict:
        return ["d", [[encode(k, ref, depth + 1), encode(v, ref, depth + 1)] for k, v in value.items()]]
    return [_CONTAINERS[base], [encode(item, ref, depth + 1) for item in value]]


def _encode_scalar(value):
    kind = type(value)
    if kind is int:
        return ["i", format(value, "x")]
    if kind is float:
        return ["f", repr(value)]
    if kind is complex:
        return ["c", repr(value.real), repr(value.imag)]
    if kind is bytes:
        return ["y", value.hex()]
    return [_SCALARS[kind]] if value is None else [_SCALARS[kind], value]


def loads(line):
    """One JSON message (bytes); WireError when it is not JSON or nested past json's own recursion."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:
        raise WireError(f"not a JSON message: {type(e).__name__}") from None


def dumps(message):
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(node, ref):
    """Tagged data -> exact builtin values; ["r", n] -> ref(n) (WireError if ref is None)."""
    return _decode(node, ref, 0, [MAX_ITEMS])


def _decode(node, ref, depth, budget):
    _check(type(node) is list and len(node) > 0 and type(node[0]) is str, "a value must be [tag, ...]")
    tag, args = node[0], node[1:]
    if tag == "r":
        _check(ref is not None and len(args) == 1 and type(args[0]) is int, "a reference is not allowed here")
        return ref(args[0])
    if tag not in _BUILD:
        return _decode_scalar(tag, args)
    _check(depth < MAX_DEPTH, f"nested deeper than {MAX_DEPTH}")
    _check(len(args) == 1 and type(args[0]) is list, f"{tag!r} needs one list")
    budget[0] -= len(args[0])
    _check(budget[0] >= 0, f"more than {MAX_ITEMS} items")
    if tag == "d":
        pairs = args[0]
        _check(all(type(p) is list and len(p) == 2 for p in pairs), "a dict needs [key, value] pairs")
        items = [(_decode(k, ref, depth + 1, budget), _decode(v, ref, depth + 1, budget)) for k, v in pairs]
    else:
        items = [_decode(item, ref, depth + 1, budget) for item in args[0]]
    try:
        return _BUILD[tag](items)
    except TypeError as e:  # an unhashable key or element
        raise WireError(str(e)) from None


def _decode_scalar(tag, args):
    texts = all(type(a) is str for a in args)
    if tag == "n" and not args:
        return None
    if tag == "b" and len(args) == 1 and type(args[0]) is bool:
        return args[0]
    if tag == "s" and len(args) == 1 and texts:
        return args[0]
    try:
        if tag == "i" and len(args) == 1 and texts:
            return int(args[0], 16)
        if tag == "y" and len(args) == 1 and texts:
            return bytes.fromhex(args[0])
        if tag in ("f", "c") and len(args) == (1 if tag == "f" else 2) and texts:
            _check(all(len(a) <= _FLOAT_TEXT for a in args), "an overlong float")
            return float(args[0]) if tag == "f" else complex(float(args[0]), float(args[1]))
    except ValueError as e:
        raise WireError(f"bad {tag!r} value: {e}") from None
    raise WireError(f"unknown or malformed tag {tag!r}")


def _check(ok, why):
    if not ok:
        raise WireError(why)


def _private_channel():
    """Binary (in, out) files on private copies of stdin/stdout; fd 0 becomes /dev/null, fd 1 stderr,
    so the code run here reads nothing of the channel and its prints cannot corrupt it."""
    channel_in, channel_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    return channel_in, channel_out


# ---- the program's sandbox ----


class _Objects:
    """The program's objects the test side holds references to (kept alive: ids stay unique)."""

    def __init__(self):
        self.items, self.index = [], {}

    def ref(self, obj):
        if id(obj) not in self.index:
            self.index[id(obj)] = len(self.items)
            self.items.append(obj)
        return self.index[id(obj)]

    def get(self, n):
        _check(type(n) is int and 0 <= n < len(self.items), f"no object #{n}")
        return self.items[n]


def _call(obj, args, kwargs):
    return obj(*args, **kwargs)


_OPS = {"call": _call, "getattr": getattr, "getitem": lambda obj, key: obj[key], "len": len, "bool": bool}
_OPS.update({"iter": list, "str": str, "repr": repr})


def serve(program):
    """Load `program` as module `solution` (its __main__ block does not run), then answer requests."""
    channel_in, channel_out = _private_channel()
    scope, objects = {"__name__": "solution"}, _Objects()
    try:
        exec(compile(program, "solution.py", "exec"), scope)
        names = [[n, objects.ref(v)] for n, v in scope.items() if not n.startswith("__")][:MAX_NAMES]
        hello = ["hello", names]
    except BaseException as e:  # SystemExit too: the module did not load
        traceback.print_exc()
        hello = ["failed", type(e).__name__]
    channel_out.write(dumps(hello))
    channel_out.flush()
    for line in channel_in:
        channel_out.write(dumps(_answer(line, objects)))
        channel_out.flush()


def _answer(line, objects):
    try:
        request = loads(line)
        _check(type(request) is list and len(request) == 3 and request[0] in _OPS, "a malformed request")
        op, target = request[0], objects.get(request[1])
        return ["ok", encode(_OPS[op](target, *decode(request[2], objects.get)), objects.ref)]
    except BaseException as e:  # whatever the program raised goes back
        try:
            return ["err", type(e).__name__[:100], str(e)[:500]]
        except BaseException:  # a __str__ that raises
            return ["err", "Exception", "?"]


# ---- the test's sandbox ----


class _Link:
    """The test side of the channel: requests out, answers in; broken for good at the first bad answer."""

    def __init__(self):
        self.channel_in, self.channel_out = _private_channel()
        self.broken, self.proxies = False, {}

    def read(self):
        line = self.channel_in.readline()
        try:
            _check(line.endswith(b"\n"), "the program's side closed")
            return loads(line)
        except WireError as e:
            self.broken = True
            raise Broken(str(e)) from None

    def ask(self, op, ref, payload):
        if self.broken:
            raise Broken("the channel is broken")
        self.channel_out.write(dumps([op, ref, encode(payload, _ref_of_remote)]))
        self.channel_out.flush()
        answer = self.read()
        try:
            if type(answer) is list and len(answer) == 2 and answer[0] == "ok":
                return decode(answer[1], self.proxy)
            _check(type(answer) is list and len(answer) == 3 and answer[0] == "err", "a malformed answer")
        except WireError as e:
            self.broken = True
            raise Broken(str(e)) from None
        raise _remote_error(answer[1], answer[2])

    def proxy(self, ref):
        if ref not in self.proxies:
            self.proxies[ref] = Remote(self, ref)
        return self.proxies[ref]


def _ref_of_remote(value):
    if type(value) is not Remote:
        raise WireError(
            f"a {type(value).__name__} cannot be sent to the program (only plain data and its objects)"
        )
    return object.__getattribute__(value, "_ref")


def _remote_error(name, message):
    name, message = (name, message) if type(name) is str and type(message) is str else ("?", "?")
    base = getattr(builtins, name, None) if name.isidentifier() and name not in _NOT_MAPPED else None
    kind = RemoteError
    if isinstance(base, type) and issubclass(base, Exception):
        with contextlib.suppress(TypeError):  # an incompatible layout: RemoteError only
            kind = type(name, (RemoteError, base), {})
    error = kind.__new__(kind)
    Exception.__init__(error, f"{name} in the program: {message[:500]}")
    return error


class Remote:
    """An object of the program (in the other sandbox). Calls, attributes, items, len, bool, iteration,
    str and repr are requests; == and hash are by identity, so an object claiming equality fails."""

    __slots__ = ("_link", "_ref")

    def __init__(self, link, ref):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_ref", ref)

    def __call__(self, *args, **kwargs):
        return _ask(self, "call", args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _ask(self, "getattr", name)

    def __getitem__(self, key):
        return _ask(self, "getitem", key)

    def __len__(self):
        return _ask(self, "len")

    def __bool__(self):
        return _ask(self, "bool")

    def __iter__(self):  # also `in`: the items come here and are compared here
        items = _ask(self, "iter")
        if type(items) is not list:
            raise Broken("iteration did not answer a list")
        return iter(items)

    def __str__(self):
        return _ask(self, "str")

    def __repr__(self):
        return _ask(self, "repr")


def _ask(remote, op, *payload):
    link, ref = object.__getattribute__(remote, "_link"), object.__getattribute__(remote, "_ref")
    return link.ask(op, ref, payload)


def _test_scope(link, names):
    """The test's globals: the program's names as proxies, except builtins' names (never the
    program's) and stdlib module names (this sandbox's own: `math.isclose` is never the program's)."""
    scope, shadowless = {"__name__": "tests", "__builtins__": builtins}, vars(builtins)
    _check(type(names) is list and len(names) <= MAX_NAMES, "bad names")
    for entry in names:
        _check(type(entry) is list and len(entry) == 2 and type(entry[0]) is str, "bad name")
        name, ref = entry
        if name in sys.stdlib_module_names and name not in ("antigravity", "this"):
            with contextlib.suppress(ImportError):
                scope[name] = __import__(name)
        elif (
            name.isidentifier() and not name.startswith("__") and name not in shadowless and type(ref) is int
        ):
            scope[name] = link.proxy(ref)
    return scope


def run_test(code):
    """Run the test `code` against the program's names; write PASS only when it ran to the end."""
    link = _Link()
    hello = link.read()
    if type(hello) is not list or len(hello) != 2 or hello[0] != "hello":
        raise Broken(f"the program did not load: {hello!r:.200}")
    try:
        scope = _test_scope(link, hello[1])
    except WireError as e:
        raise Broken(str(e)) from None
    exec(compile(code, "tests.py", "exec"), scope)
    if not link.broken:
        link.channel_out.write(dumps(PASS))
        link.channel_out.flush()
