"""Drafter service: hosts a drafter (dspark.drafters.make_drafter), keeps each request's token
sequence, draft random stream and (DSpark) context features, and streams one DraftBlock per
request and round. `server.py` serves it, `client.py` (RemoteDrafter) calls it."""
