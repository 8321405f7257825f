-- On-call reads: a record's dead letters by (policy, item) for
-- `GET /policies/{policy}/items/{key}` (its audit rows use audit_by_item, its effects the
-- effects' primary key).
create index dead_letters_by_item on sweeper.dead_letters (policy, item_key) where kind = 'item';
