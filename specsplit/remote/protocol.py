"""What both ends of the wire agree on: the protocol version every worker and client announces."""

PROTOCOL_VERSION = "specsplit.v1"
