"""The worker's own tools: device tools over MQTT 5 request/response (mqtt.py), MCP servers
(mcp.py: stdio and streamable HTTP with the official SDK; mcp_mqtt.py: MCP over MQTT), and the
toolbox that offers them to sessions and runs their calls (toolbox.py). The core sees only
port.py."""
