"""mosquitto with users and the topic ACL of docs/security.md (read from the document, so that
the recipe is what is tested), and an in-process worker that logs in as the user ``worker``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import REPO
from .inproc import LiveWorker
from .mosquitto import Mosquitto, password_file

if TYPE_CHECKING:
    pass

PASSWORDS = {"worker": "worker-secret", "alice": "alice-secret", "bob": "bob-secret", "devices": "devices-secret"}


def documented_acl() -> str:
    """The ```acl block of docs/security.md's "Topic ACL" section."""
    text = (REPO / "docs" / "security.md").read_text()
    section = text.split("## Topic ACL", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```acl\n(.*?)```", section, re.S)
    assert match, "docs/security.md: no ```acl block in the Topic ACL section"
    return match.group(1)


def documented_device_acl() -> str:
    """The ```acl block of docs/security.md's "Device tools: broker ACL recipe" section."""
    text = (REPO / "docs" / "security.md").read_text()
    section = text.split("## Device tools: broker ACL recipe", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```acl\n(.*?)```", section, re.S)
    assert match, "docs/security.md: no ```acl block in the device tools' ACL section"
    return match.group(1)


def documented_acl_broker(tmp_path: Path, *, websockets: bool = False, devices: bool = False) -> Mosquitto:
    """mosquitto with PASSWORDS and docs/security.md's ACL (and a WebSockets listener), started.
    ``devices``: with the device tools' recipe appended, as the document says to."""
    passwd = password_file(tmp_path / "passwd", PASSWORDS)
    acl = tmp_path / "acl"
    acl.write_text(documented_acl() + ("\n" + documented_device_acl() if devices else ""))
    broker = Mosquitto(
        tmp_path,
        f"allow_anonymous false\npassword_file {passwd}\nacl_file {acl}\n",
        keep_root=True,  # mosquitto as root can read the files in pytest's 0700 directories
        autosave="default",
        websockets=websockets,
    )
    broker.start()
    return broker


def logged_in_worker(port: int, **sections: dict[str, Any]) -> LiveWorker:
    """A LiveWorker on the documented topics (prefix chat, worker id gpu-1) that logs in as
    the user worker."""
    login = {"topic_prefix": "chat", "worker_id": "gpu-1", "username": "worker", "password": PASSWORDS["worker"]}
    others: dict[str, Any] = sections  # sections only (a ToolSupport is not among them)
    return LiveWorker(port, engine=None, mqtt=login | sections.pop("mqtt", {}), **others)
