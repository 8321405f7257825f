\set s random(1, 399000)
begin;
delete from demo.tickets t where id in (select unnest(array(select generate_series(:s::bigint, :s::bigint + 249)))) and closed_at < '2026-06-01' and not exists (select 1 from legal.holds h where h.customer_id = t.customer_id and h.released_at is null and (h.scope = any('{all,tickets}') or h.scope is null));
rollback;
