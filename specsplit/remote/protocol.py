"""What both ends of the wire agree on: the protocol version every worker and client announces."""

# The minor version changes when a field a worker must not ignore is added (an older worker would
# drop it silently: logits processing in verify and generate requests).
PROTOCOL_VERSION = "specsplit.v1.2"
