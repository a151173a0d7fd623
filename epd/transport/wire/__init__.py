"""How a consumer reaches a producer's outputs: NIXL one-sided READs (:mod:`.nixl`, over the agent
of :mod:`.agent`) or bytes inline in the request (:mod:`.inline`), both behind :mod:`.base`'s
small interface; the location format and its tag (:mod:`.location`, no NIXL needed); the
credentials that open a producer's arena (:mod:`.credentials`)."""
