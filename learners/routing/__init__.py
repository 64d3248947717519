"""Routing: the router's training on seed examples and routing labels, and the router run that
judges and promotes a successor."""
