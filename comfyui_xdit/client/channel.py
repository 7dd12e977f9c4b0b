"""The authenticated control channel lives with the workers (both sides use it)."""
from comfyui_xdit import bridge

_channel = bridge.channel
AuthError, Channel = _channel.AuthError, _channel.Channel
connect, parse_address, server_handshake = (_channel.connect, _channel.parse_address,
                                            _channel.server_handshake)
