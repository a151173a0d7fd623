"""The producer's memory: one shared buffer (:mod:`.shared_buffer`) registered once and split
into slots (:mod:`.slots`), leased per item and kept as a cache (:mod:`.arena`), each slot behind
a header that names its item and fill (:mod:`.slot_header`), and the encoder service's claims on
leases (:mod:`.claims`)."""
