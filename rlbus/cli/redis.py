"""``rlbus redis``: the run's Redis ACL users per role."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from rlbus.cli.common import (
    console,
    print_error,
    run_async,
    typer_app,
)

app = typer_app(help="The run's Redis: ACL users per role (least privilege).", no_args_is_help=True)


@app.command("users")
def redis_users(
    namespace: Annotated[str, typer.Option(
        envvar="RLBUS_NAMESPACE", help="The run namespace (run.namespace); \"\" for a run without one.")] = "",
    url: Annotated[
        str, typer.Option("--url", envvar="RLBUS_REDIS_ADMIN_URL", help="Redis URL of an admin (ACL SETUSER allowed).")
    ] = "redis://127.0.0.1:6379/0",
    key_prefix: Annotated[
        str | None, typer.Option(help="The run's state.key_prefix, when its config sets one.")
    ] = None,
    password_dir: Annotated[Path | None, typer.Option(
        help="One file per role holding its password; missing ones are created (random, mode 0600). "
             "$RLBUS_REDIS_PASSWORD_<ROLE> wins over a file.")] = None,
    role: Annotated[
        list[str] | None, typer.Option("--role", metavar="ROLE", help="Only this role (repeat; default: every role).")
    ] = None,
    disable_default: Annotated[bool, typer.Option(
        "--disable-default", help="Then turn the passwordless default user off, as production does.")] = False,
) -> None:
    """Create or update the ACL user of every role of a run (rlbus/security/redis_acl.py), each allowed only
    its own keys and commands, and print each role's URL (without its password)."""
    from rlbus.security import redis_acl

    roles = tuple(role) if role else redis_acl.ROLES
    try:
        for name in roles:
            redis_acl.check_role(name)
        redis_acl.role_rules(roles[0], namespace, key_prefix=key_prefix)  # a bad namespace fails before any file
        passwords, created = redis_acl.read_passwords(roles, directory=password_dir)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        users = run_async(lambda: redis_acl.apply_users(url, passwords, namespace=namespace, key_prefix=key_prefix,
                                                   disable_default=disable_default))
    except ValueError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    for name, user in users.items():
        source = f"${redis_acl.password_env(name)}" if os.environ.get(redis_acl.password_env(name)) else (
            f"{password_dir / name}{' (created)' if name in created else ''}" if password_dir else "")
        console.print(f"{name:<9} {escape(redis_acl.role_url(url, user))}  password: {escape(source)}",
                      highlight=False, soft_wrap=True)
    if disable_default:
        console.print("default user: off", highlight=False)
