"""A tiny MCP-over-MQTT server (EMQX's specification, the server side; see
worker/tools/mcp_mqtt.py for the topics) for the tests and the demo: a thermostat with the
tools get_temperature, set_temperature and add.

    python -m devtools.mcp_mqtt_server --port 1883 --name home/livingroom/thermostat

It connects with MQTT 5, client id = its server-id, a will that clears its retained presence,
publishes ``notifications/server/online`` retained on ``R-server/presence/S/N``, answers
``initialize`` on its control topic ``R-server/S/N`` (the client's id from the
``MCP-MQTT-CLIENT-ID`` user property), then ``tools/list``, ``tools/call`` and ``ping`` on
``R-rpc/C/S/N`` (subscribed with No Local). ``stop()`` clears the presence first, as the
specification requires; ``crash()`` drops the connection so that the broker sends the will.

For the fault tests, two tools misbehave on demand when a test lists them (``tools``):
``fail {"error": <any JSON>}`` answers with that JSON-RPC ``error`` member as is, ``raw
{"payload": "..."}`` publishes the payload as is (``@ID@``: the call's id).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

NUMBER = {"type": "number"}
TOOLS: list[dict[str, Any]] = [
    {
        "name": "get_temperature",
        "description": "The temperature of the room, in °C.",
        "inputSchema": {"type": "object", "properties": {}},
    },
    {
        "name": "set_temperature",
        "description": "Set the room's target temperature, in °C (5 to 30).",
        "inputSchema": {"type": "object", "properties": {"celsius": NUMBER}, "required": ["celsius"]},
    },
    {
        "name": "add",
        "description": "Add two numbers.",
        "inputSchema": {"type": "object", "properties": {"a": NUMBER, "b": NUMBER}, "required": ["a", "b"]},
    },
]


def _props(client_id: str) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.UserProperty = [("MCP-COMPONENT-TYPE", "mcp-server"), ("MCP-MQTT-CLIENT-ID", client_id)]
    return props


class McpMqttServer:
    def __init__(
        self,
        port: int,
        name: str = "home/livingroom/thermostat",
        *,
        server_id: str | None = None,
        root: str = "$mcp",
        host: str = "127.0.0.1",
        description: str = "A room thermostat: read the temperature, set the target.",
    ) -> None:
        self.port, self.host, self.name, self.root = port, host, name, root
        self.server_id = server_id or f"thermostat-{uuid.uuid4().hex[:12]}"
        self.description = description
        self.target = 21.0
        self.tools = [dict(tool) for tool in TOOLS]
        self.clients: set[str] = set()
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.lists = 0  # tools/list requests answered
        self.presence = f"{root}-server/presence/{self.server_id}/{name}"
        self.control = f"{root}-server/{self.server_id}/{name}"
        self.capability = f"{root}-server/capability/{self.server_id}/{name}"
        self._ready = threading.Event()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.server_id, protocol=mqtt.MQTTv5)
        connect_props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        connect_props.UserProperty = [("MCP-COMPONENT-TYPE", "mcp-server"), ("MCP-META", "{}")]
        self._connect_props = connect_props
        # The will clears the retained presence when the connection drops without a goodbye.
        self._client.will_set(self.presence, b"", qos=1, retain=True)
        self._client.on_connect = self._on_connect
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe
        # Initialize answers held until the broker granted the client's RPC topic (its SUBACK):
        # the client's next message must find the subscription (the specification's order).
        self._held: dict[int, tuple[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> McpMqttServer:
        self._client.connect(self.host, self.port, keepalive=5, clean_start=True, properties=self._connect_props)
        self._client.loop_start()
        if not self._ready.wait(10):
            raise RuntimeError("the MCP-over-MQTT server could not subscribe")
        online = {
            "jsonrpc": "2.0",
            "method": "notifications/server/online",
            "params": {"server_name": self.name, "description": self.description, "meta": {}},
        }
        self._publish(self.presence, online, retain=True).wait_for_publish(10)
        return self

    def stop(self) -> None:
        """A clean shutdown: the presence cleared, then DISCONNECT (no will)."""
        self._publish_raw(self.presence, b"", retain=True).wait_for_publish(10)
        self._client.disconnect()
        self._client.loop_stop()

    def crash(self) -> None:
        """The connection dropped without DISCONNECT: the broker publishes the will."""
        self._client.loop_stop()
        sock = self._client.socket()
        if sock is not None:
            sock.close()

    def add_tool(self, tool: dict[str, Any]) -> None:
        """Offer one more tool and say so on the capability topic."""
        self.tools.append(tool)
        self._publish(self.capability, {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})

    # -- MQTT ---------------------------------------------------------------------------

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        client.subscribe([(self.control, SubscribeOptions(qos=1))])

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, properties: Any) -> None:
        with self._lock:
            held = self._held.pop(mid, None)
        if held is None:
            self._ready.set()  # the control topic's
        else:
            self._publish(*held)

    def _publish(self, topic: str, message: dict[str, Any], *, retain: bool = False) -> mqtt.MQTTMessageInfo:
        return self._publish_raw(topic, json.dumps(message).encode(), retain=retain)

    def _publish_raw(self, topic: str, payload: bytes, *, retain: bool = False) -> mqtt.MQTTMessageInfo:
        return self._client.publish(topic, payload, qos=1, retain=retain, properties=_props(self.server_id))

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            message = json.loads(msg.payload)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        method = message.get("method")
        if msg.topic == self.control and method == "initialize":
            users = dict(getattr(msg.properties, "UserProperty", []) or [])
            client_id = users.get("MCP-MQTT-CLIENT-ID")
            if not client_id:
                return
            rpc = f"{self.root}-rpc/{client_id}/{self.server_id}/{self.name}"
            result = {
                "protocolVersion": message.get("params", {}).get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": self.name, "version": "0.1"},
            }
            welcome = {"jsonrpc": "2.0", "id": message.get("id"), "result": result}
            if client_id in self.clients:
                self._publish(rpc, welcome)
                return
            self.clients.add(client_id)
            with self._lock:
                _, mid = client.subscribe(
                    [
                        (rpc, SubscribeOptions(qos=1, noLocal=True)),
                        (f"{self.root}-client/presence/{client_id}", SubscribeOptions(qos=1)),
                        (f"{self.root}-client/capability/{client_id}", SubscribeOptions(qos=1)),
                    ]
                )
                if mid is not None:
                    self._held[mid] = (rpc, welcome)
            return
        if msg.topic.startswith(f"{self.root}-client/presence/"):
            self.clients.discard(msg.topic.rsplit("/", 1)[-1])
            return
        if not msg.topic.startswith(f"{self.root}-rpc/") or "id" not in message or method is None:
            return
        answer: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"]}
        if method == "ping":
            answer["result"] = {}
        elif method == "tools/list":
            answer["result"] = {"tools": self.tools}
            self.lists += 1
        elif method == "tools/call":
            params = message.get("params") or {}
            arguments = params.get("arguments") or {}
            if params.get("name") == "fail":  # answers the error member it is given, as is
                answer["error"] = arguments.get("error")
            elif params.get("name") == "raw":  # publishes the payload it is given, "@ID@" the call's id
                payload = str(arguments.get("payload", "")).replace("@ID@", json.dumps(message["id"]))
                self._publish_raw(msg.topic, payload.encode("utf-8", errors="surrogatepass"))
                return
            else:
                answer["result"] = self._call(str(params.get("name")), arguments)
        else:
            answer["error"] = {"code": -32601, "message": f"method not found: {method}"}
        self._publish(msg.topic, answer)

    def _call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((name, arguments))

        def text(value: str, error: bool = False) -> dict[str, Any]:
            return {"content": [{"type": "text", "text": value}], "isError": error}

        if name == "get_temperature":
            return text(f"{self.target:g} °C")
        if name == "set_temperature":
            celsius = float(arguments.get("celsius", 0))
            if not 5 <= celsius <= 30:
                return text(f"{celsius:g} °C is out of range (5 to 30)", error=True)
            self.target = celsius
            return text(f"target set to {celsius:g} °C")
        if name == "add":
            total = float(arguments.get("a", 0)) + float(arguments.get("b", 0))
            return text(str(int(total)) if total.is_integer() else repr(total))
        if any(tool["name"] == name for tool in self.tools):
            return text(f"{name} done")
        return text(f"unknown tool {name}", error=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--name", default="home/livingroom/thermostat")
    parser.add_argument("--root", default="$mcp")
    args = parser.parse_args()
    server = McpMqttServer(args.port, args.name, root=args.root, host=args.host).start()
    print(f"MCP-over-MQTT server {server.name} ({server.server_id}) on {args.host}:{args.port}; Ctrl-C stops it")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
