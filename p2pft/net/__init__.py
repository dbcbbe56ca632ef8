"""The asyncio driver that binds the node to TCP, the control wire format, the admin client."""
