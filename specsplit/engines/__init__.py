"""The draft and target engines: sessions, tree growth, verification, drafters."""
