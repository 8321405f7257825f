\set s random(1, 399000)
begin;
delete from demo.tickets where id in (select unnest(array(select generate_series(:s::bigint, :s::bigint + 249)))) and (coalesce(closed_at < '2026-06-01', false)) and (case when legal_hold is null then 'unknown_legal_hold' when legal_hold = true then 'legal_hold' end) is null;
rollback;
