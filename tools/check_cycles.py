"""Fail if any import cycle joins specrpc's modules (TYPE_CHECKING and function-level imports counted): `make lint`.

import-linter's layers keep packages in order; this keeps modules within a package from leaning on each other."""

from __future__ import annotations

import sys

import grimp


def cycles(package: str) -> list[list[str]]:
    """Strongly connected groups of more than one module in `package`'s import graph (Tarjan's algorithm)."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=False)
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for module in modules:
        if module not in index:
            visit(module)
    return found


def main() -> int:
    found = cycles("specrpc")
    for group in found:
        print("import cycle:", " ⇄ ".join(group))
    print(f"{len(found)} import cycles")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
