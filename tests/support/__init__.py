"""What the tests share: daemons, Redis servers, nodes, tiny models, store fixtures and child processes."""
