"""Dense Assist's machinery: the stream's messages (assist_types), the per-session shared-memory
rings and their doorbells (shm_ring, shm_doorbell, ring_pacing), the TCP link between hosts
(assist_tcp_link), and cooperative joins of assisted rows into the GPU engine's step
(join_desk, joined_step). The daemons' session logic is in cpu_service/ and gpu_service/."""
