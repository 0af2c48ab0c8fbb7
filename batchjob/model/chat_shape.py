"""Many chat prompts that differ in one message's text, tokenized without rendering and tokenizing each whole.

Rendering a chat template (jinja2, sandboxed) and tokenizing the result per row was most of a million-row plan's
time. Rows that share everything but one message's content (the job's system text and one user message, say) share
a *shape*: the template is rendered once with a sentinel in the hole, giving `head + content + tail`, and only the
stretch around the content, between the last special token of the head and the first of the tail, is tokenized per
row. Both steps are used only where they give exactly what per-row rendering and tokenizing would:
- `template_inserts_content_verbatim`: the template's syntax tree shows that a message's content reaches the output
  only as text concatenated into `{{ ... }}`, never tested, filtered, passed on or looped over, so the output is a
  pure function of everything else with the content pasted in.
- `splits_at_added_tokens`: the tokenizer cuts the text at its added tokens first and tokenizes the pieces
  independently (no normalizer, pre-tokenizers that work on each piece alone, no stripping added tokens); a row whose
  content would form an added token across the cut (`can_cut`) is tokenized whole instead.
tests/model/test_chat_shape.py compares both against per-row rendering and tokenizing on tricky content."""

from __future__ import annotations

import json
from collections.abc import Callable

import jinja2
from jinja2 import nodes
from tokenizers import Tokenizer as HFTokenizer

# Node types an output holding a message's content may sit in: ones that choose whether it is written, not how.
_PLAIN_BLOCKS = (nodes.Template, nodes.For, nodes.If, nodes.With, nodes.Scope)
# Filters and tests that read a list of messages or a message without reading any content.
_SAFE_FILTERS = {"length", "count"}
_MESSAGE_FILTERS = {"first", "last"}  # return a message, checked like one
_SAFE_TESTS = {"defined", "undefined", "none", "mapping", "sequence", "iterable"}
_DICT_METHODS = {"items", "values", "keys", "get", "pop", "copy", "update", "setdefault"}
# Pre-tokenizers that split each piece of text on its own (Metaspace's "first" prepends to the first piece only).
_PIECEWISE_PRE_TOKENIZERS = {"Digits", "Split", "Punctuation", "Whitespace", "WhitespaceSplit", "ByteLevel"}
Chat = tuple[list[dict], int]  # messages, and the one whose content differs between chats of the same shape
SENTINELS = ("\ue000batchjob-a\ue001", "\ue000batchjob-b\ue001")  # private-use characters around a name


def template_inserts_content_verbatim(env: jinja2.Environment, source: str) -> bool:
    tree = env.parse(source)
    parents: dict[int, nodes.Node] = {}
    stack: list[nodes.Node] = [tree]
    while stack:
        node = stack.pop()
        for child in node.iter_child_nodes():
            parents[id(child)] = node
            stack.append(child)
    names = _message_names(tree)
    if names is None:
        return False
    checked: set[int] = set()  # content accesses found to flow into output verbatim

    def content_flows_to_output(node: nodes.Node) -> bool:
        parent = parents[id(node)]
        while isinstance(parent, (nodes.Add, nodes.Concat)):
            node, parent = parent, parents[id(parent)]
        if not isinstance(parent, nodes.Output):
            return False
        while not isinstance(parent, nodes.Template):
            parent = parents[id(parent)]
            if not isinstance(parent, _PLAIN_BLOCKS):
                return False
        return True

    def message_use_is_safe(node: nodes.Node) -> bool:
        parent = parents[id(node)]
        if isinstance(parent, (nodes.Getitem, nodes.Getattr)) and parent.node is node:
            key = _key(parent)
            if key == "content":
                checked.add(id(parent))
                return content_flows_to_output(parent)
            if isinstance(key, str):
                return key not in _DICT_METHODS  # role and the like: fixed by the shape
            return message_use_is_safe(parent)  # an index or a slice: still messages
        if isinstance(parent, nodes.Filter) and parent.node is node:
            return parent.name in _SAFE_FILTERS or (parent.name in _MESSAGE_FILTERS and message_use_is_safe(parent))
        if isinstance(parent, nodes.Test) and parent.node is node:
            return parent.name in _SAFE_TESTS
        # Looping over messages or naming them: the names bound are checked where they are used.
        return (isinstance(parent, nodes.For) and parent.iter is node) or (
            isinstance(parent, (nodes.Assign, nodes.With)) and any(v is node for v in _bound_values(parent))
        )

    for name in tree.find_all(nodes.Name):
        if name.ctx == "load" and name.name in names and not message_use_is_safe(name):
            return False
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        if isinstance(node, nodes.Getattr) and node.attr in {"previtem", "nextitem"}:
            return False  # loop.previtem is a message reached by no name
        if _key(node) == "content" and id(node) not in checked:
            return False  # content of something not known as a message (a macro's argument, ...)
    for const in tree.find_all(nodes.Const):
        parent = parents[id(const)]
        if const.value == "content" and not (isinstance(parent, nodes.Getitem) and parent.arg is const):
            return False  # map(attribute='content'), message.get('content'), ...
    return True


def _key(node: nodes.Getitem | nodes.Getattr):
    return node.attr if isinstance(node, nodes.Getattr) else getattr(node.arg, "value", None)


def _bound_values(node: nodes.Node) -> list[nodes.Expr]:
    return [node.node] if isinstance(node, nodes.Assign) else list(node.values) if isinstance(node, nodes.With) else []


def _names(expr: nodes.Node) -> list[nodes.Name]:
    return [expr] if isinstance(expr, nodes.Name) else list(expr.find_all(nodes.Name))


def _message_names(tree: nodes.Template) -> set[str] | None:
    """`messages` and every name bound to something computed from it (loop variables, `set`, `with`); None when
    such a thing is bound to something other than a name (a namespace's attribute), which is not followed."""
    names, grown = {"messages"}, True
    while grown:
        grown = False
        bindings = [(n.target, n.iter) for n in tree.find_all(nodes.For)]
        bindings += [(n.target, n.node) for n in tree.find_all(nodes.Assign)]
        bindings += [(t, v) for n in tree.find_all(nodes.With) for t, v in zip(n.targets, n.values)]
        for target, value in bindings:
            if not any(n.name in names for n in _names(value)):
                continue
            if not isinstance(target, (nodes.Name, nodes.Tuple)):
                return None
            for bound in _names(target):
                grown |= bound.name not in names
                names.add(bound.name)
    return names


def splits_at_added_tokens(backend: HFTokenizer) -> bool:
    config = json.loads(backend.to_str())
    model = config.get("model") or {}
    return (
        config.get("normalizer") is None
        and config.get("truncation") is None
        and config.get("padding") is None
        and model.get("dropout") is None
        and _piecewise(config.get("pre_tokenizer"))
        and not any(t.lstrip or t.rstrip or t.single_word for t in backend.get_added_tokens_decoder().values())
    )


def _piecewise(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_piecewise(p) for p in pre["pretokenizers"])
    if pre.get("type") == "ByteLevel":
        return not pre.get("add_prefix_space")
    return pre.get("type") in _PIECEWISE_PRE_TOKENIZERS


class ChatShape:
    """One conversation with a hole for one message's content: `text(content)` is what the template renders, and
    `head_ids + encode(middle(content)) + tail_ids` its token ids wherever `can_cut(content)`."""

    def __init__(self, render: Callable[[str], str], backend: HFTokenizer, cut: bool):
        pieces = [render(s).split(s) for s in SENTINELS]
        if len(pieces[0]) != 2 or pieces[0] != pieces[1]:
            raise ValueError("the template does not write the content exactly once")
        self.head, self.tail = pieces[0]
        self.cut = cut
        if not cut:
            return
        added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        head = backend.encode(self.head, add_special_tokens=False)
        tail = backend.encode(self.tail, add_special_tokens=False)
        # Cut after the head's last added token and before the tail's first: the text in between is one piece.
        end = max((e for i, (_, e) in zip(head.ids, head.offsets) if i in added), default=0)
        start = min((s for i, (s, _) in zip(tail.ids, tail.offsets) if i in added), default=len(self.tail))
        self.head_ids = backend.encode(self.head[:end], add_special_tokens=False).ids
        self.tail_ids = backend.encode(self.tail[start:], add_special_tokens=False).ids
        self.before, self.after = self.head[end:], self.tail[:start]
        tokens = set(added.values())
        self.reach = max(map(len, tokens), default=1)
        # An added token across the head/content seam starts with a suffix of the head; across content/tail it
        # ends with a prefix of the tail. These are the rest of such tokens, which a content must not supply.
        self.opening = {t[k:] for t in tokens for k in range(1, len(t)) if self.head.endswith(t[:k])}
        self.closing = {t[:k] for t in tokens for k in range(1, len(t)) if self.tail.startswith(t[k:])}

    def text(self, content: str) -> str:
        return self.head + content + self.tail

    def can_cut(self, content: str) -> bool:
        if not self.cut:
            return False
        if self.opening and any((content + self.tail[: self.reach]).startswith(t) for t in self.opening):
            return False
        return not (self.closing and any((self.head[-self.reach :] + content).endswith(t) for t in self.closing))

    def middle(self, content: str) -> str:
        return self.before + content + self.after
