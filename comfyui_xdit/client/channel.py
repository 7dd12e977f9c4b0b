"""The authenticated control channel lives with the workers (both sides use it)."""
from comfyui_xdit.client.worker_modules import worker_module

_channel = worker_module("runtime.channel")
AuthError, Channel = _channel.AuthError, _channel.Channel
connect, parse_address, server_handshake = (_channel.connect, _channel.parse_address,
                                            _channel.server_handshake)
