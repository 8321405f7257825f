-- Hardening from black-box testing (issue 11).

-- The size of a quarantined envelope's whole body, in bytes: raw_body keeps only its first
-- 8 KiB, raw_sha256 covers every byte, and a push body over the envelope limit is quarantined
-- rather than refused (DESIGN §5), so its size is evidence of its own.
alter table sweeper.dead_letters add column raw_size bigint;
