"""pdwire's own protocol: the hand-written migration steps its generated codec calls."""
