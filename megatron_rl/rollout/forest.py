"""The rollout forest (Iris' partial rollout): committed message states of unfinished sessions.

One tree per prompt. Its root is the prompt; each sample of the prompt's group is a path down
from it, one node per committed message: the turns that message added (exact tokens, loss mask,
engine log-probs and the weight version of every token), the trajectory's fields at that point
and the agent's loop state after it (`agents.base.Resume`). A session cut at a step boundary
resumes from its deepest node, possibly under newer weights, so one trajectory splices
prefixes sampled by several policy versions; every token keeps its own version and engine
log-prob, which is what truncated importance sampling corrects with.

Nodes hold plain JSON (`Turn` as a dict), so the forest is saved in checkpoints as is and a
later mutation of a live `Trajectory` cannot reach a committed prefix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_rl.records.trajectory import Trajectory

_TRAJECTORY_FIELDS = ("uid", "group_id", "question", "reference", "answer", "labels",
                      "rewards", "metadata")


@dataclass
class Node:
    id: int
    parent: int | None
    tree: str                        # the prompt uid (the tree's key)
    turns: list[dict[str, Any]] = field(default_factory=list)   # added by this message
    fields: dict[str, Any] = field(default_factory=dict)  # trajectory fields after it
    state: dict[str, Any] = field(default_factory=dict)   # the agent's loop state after it
    depth: int = 0                   # turns on the path from the root, this node's included


class RolloutForest:
    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {}
        self.roots: dict[str, int] = {}
        self._next_id = 0

    def _add(self, node: Node) -> int:
        self.nodes[node.id] = node
        self._next_id = max(self._next_id, node.id + 1)
        return node.id

    def root(self, tree: str) -> int:
        """The root of a prompt's tree (created on first use)."""
        if tree not in self.roots:
            self.roots[tree] = self._add(Node(self._next_id, None, tree))
        return self.roots[tree]

    def commit(self, parent: int, traj: Trajectory, state: dict[str, Any]) -> int:
        """A child of `parent` holding the turns `traj` added since it, and `state`."""
        up = self.nodes[parent]
        if len(traj.turns) < up.depth:
            raise ValueError(f"trajectory {traj.uid} has {len(traj.turns)} turns, fewer than "
                             f"the {up.depth} already committed at node {parent}")
        added = [t.to_dict() for t in traj.turns[up.depth:]]  # JSON-safe tool calls
        fields = {k: _copy(getattr(traj, k)) for k in _TRAJECTORY_FIELDS}
        return self._add(Node(self._next_id, parent, up.tree, added, fields, _copy(state),
                              len(traj.turns)))

    def path(self, node_id: int) -> list[Node]:
        out = []
        node: Node | None = self.nodes[node_id]
        while node is not None:
            out.append(node)
            node = self.nodes[node.parent] if node.parent is not None else None
        return out[::-1]

    def resume(self, node_id: int) -> tuple[Trajectory, dict[str, Any]] | None:
        """The trajectory up to `node_id` and the agent state after it; None at a root."""
        nodes = self.path(node_id)
        leaf = nodes[-1]
        if leaf.parent is None:
            return None
        turns = [t for n in nodes for t in n.turns]
        return Trajectory.from_dict({**_copy(leaf.fields), "turns": _copy(turns)}), \
            _copy(leaf.state)

    def release(self, tree: str) -> None:
        """Drop a prompt's tree (its group was trained on, or restarts from scratch)."""
        root = self.roots.pop(tree, None)
        if root is not None:
            self.nodes = {i: n for i, n in self.nodes.items() if n.tree != tree}

    def versions(self, node_id: int) -> set[int]:
        """The weight versions that sampled the committed prefix (for metrics and tests)."""
        return {v for n in self.path(node_id) for t in n.turns for v in t["weight_versions"]}

    def state_dict(self) -> dict[str, Any]:
        return {"next_id": self._next_id, "roots": dict(self.roots),
                "nodes": [asdict(n) for n in self.nodes.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.nodes = {n["id"]: Node(**n) for n in state["nodes"]}
        self.roots = dict(state["roots"])
        self._next_id = int(state["next_id"])

    @property
    def metrics(self) -> dict[str, float]:
        return {"forest/trees": float(len(self.roots)), "forest/nodes": float(len(self.nodes))}


_SCALARS = frozenset({int, float, str, bool, type(None)})


def _copy(x: Any) -> Any:
    """A deep copy of plain JSON-like data (dicts, lists, scalars)."""
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        # a flat list (token ids, log-probs) is copied whole: its types checked in C, not
        # each item recursed into (a resumed session's turns took ~6 ms a step here)
        if _SCALARS.issuperset(map(type, x)):
            return list(x)
        return [_copy(v) for v in x]
    return x
