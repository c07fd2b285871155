"""Many models behind one gateway: pools (one model each) and the public names routed to them."""
