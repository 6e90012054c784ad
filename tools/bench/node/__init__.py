"""attnstore bench node: concurrent openai clients (``load``) against the node and two baseline servers
(``server``), driven by ``command``."""
