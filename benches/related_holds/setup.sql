-- 400,000 tickets of 1,000 customers; holds per customer: 50 active, 50 released, 10 with a NULL
-- scope. The own-column contender reads the same holds from a flag on each ticket.
create schema demo;
create schema legal;
create table demo.tickets (id bigint primary key, customer_id bigint, status text,
                           legal_hold boolean, closed_at timestamptz);
create index on demo.tickets (closed_at);
insert into demo.tickets
select i, i % 1000, 'closed', false, timestamptz '2026-01-01' from generate_series(1, 400000) i;
create table legal.holds (id bigserial primary key, customer_id bigint, scope text,
                          released_at timestamptz);
create index on legal.holds (customer_id);
insert into legal.holds (customer_id, scope, released_at)
select c, 'all', null from generate_series(1, 50) c
union all select c, 'all', now() from generate_series(51, 100) c
union all select c, null, null from generate_series(101, 110) c;
update demo.tickets set legal_hold = true
 where customer_id between 1 and 50 or customer_id between 101 and 110;
vacuum analyze;
