#!/usr/bin/env python
"""A flame graph (SVG) from collapsed stacks: py-spy's raw output (`frame;frame;... count` per line).

    .venv/bin/python scripts/flamegraph_svg.py prof.txt -o prof.svg [--title T] [--min-share 0.002]

One box per frame on a stack, as wide as its share of the samples, callers below callees; a
box's tooltip gives the frame and its share. py-spy writes either raw or SVG from one
recording; round_overhead.py --profile keeps the raw stacks (for profile_summary.py's tables)
and draws the graphs with this.
"""

from __future__ import annotations

import argparse
import hashlib
import html
from dataclasses import dataclass, field
from pathlib import Path

WIDTH = 1400
ROW = 16


@dataclass
class Node:
    name: str
    count: int = 0
    children: dict[str, Node] = field(default_factory=dict)


def read_stacks(path: Path) -> Node:
    root = Node("all")
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        root.count += n
        node = root
        for frame in stack.split(";"):
            node = node.children.setdefault(frame, Node(frame))
            node.count += n
    return root


def colour(name: str) -> str:
    h = hashlib.md5(name.encode()).digest()
    return f"rgb({205 + h[0] % 50},{80 + h[1] % 120},{40 + h[2] % 40})"


def render(root: Node, title: str, min_share: float) -> str:
    boxes: list[str] = []
    depth_max = 0

    def walk(node: Node, x: float, depth: int) -> None:
        nonlocal depth_max
        width = node.count / root.count * WIDTH
        if node.count / root.count < min_share:
            return
        depth_max = max(depth_max, depth)
        share = node.count / root.count * 100
        label = html.escape(node.name)
        text = label if width > 40 else ""
        boxes.append(
            f"<g><title>{label} ({share:.1f}%)</title>"
            f'<rect x="{x:.1f}" y="{{Y{depth}}}" width="{max(width - 0.5, 0.1):.1f}" height="{ROW - 1}" '
            f'fill="{colour(node.name)}"/>'
            f'<text x="{x + 2:.1f}" y="{{T{depth}}}" font-size="11" font-family="monospace" '
            f'textLength="{max(width - 4, 1):.0f}" lengthAdjust="spacingAndGlyphs">{text[: int(width / 6.5)]}</text></g>'
        )
        cx = x
        for child in sorted(node.children.values(), key=lambda c: c.name):
            walk(child, cx, depth + 1)
            cx += child.count / root.count * WIDTH

    walk(root, 0.0, 0)
    height = (depth_max + 1) * ROW + 40
    body = "\n".join(boxes)
    for d in range(depth_max + 1):  # callers at the bottom
        y = height - 10 - (d + 1) * ROW
        body = body.replace(f"{{Y{d}}}", str(y)).replace(f"{{T{d}}}", str(y + ROW - 4))
    head = f'<text x="4" y="16" font-size="14" font-family="sans-serif">{html.escape(title)}</text>'
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}">\n<rect width="100%" height="100%" fill="white"/>\n{head}\n{body}\n</svg>\n'
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stacks", type=Path, help="collapsed stacks (py-spy record -f raw)")
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--title", default="")
    parser.add_argument("--min-share", type=float, default=0.002, help="leave out frames below this share of samples")
    args = parser.parse_args()
    root = read_stacks(args.stacks)
    if not root.count:
        raise SystemExit(f"flamegraph_svg: no samples in {args.stacks}")
    args.out.write_text(render(root, args.title or args.stacks.name, args.min_share))


if __name__ == "__main__":
    main()
